"""The whole loop on a tiny random model and a trivially learnable environment: learning, resume, masks, configs."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agentgym_jax.errors import ConfigError
from agentgym_jax.run_config import base_config, validate_run_config
from tests.tiny_models import save_tiny_chat_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def tiny_config(model_dir, workdir, **train):
    c = base_config()
    c.model.path = str(model_dir)
    c.env.name = "letters"
    c.env.import_modules = ("tests.synthetic_env",)
    c.env.num_workers = 0
    c.env.kwargs = dict(turns=2)
    c.data.update(dict(tasks_per_step=4, samples_per_task=4, validation_tasks=4, test_tasks=8))
    c.rollout.update(dict(max_turn_tokens=1, max_trajectory_tokens=192, system_prompt="You are a bot.",
                          canned_reply=""))
    c.horizon.type, c.horizon.turns = "fixed", 2
    c.algo.update(dict(
        old_logp_source="sampler", learning_rate=3e-2, kl_coef=0.0, entropy_coef=0.0, minibatch_size=16,
        microbatch_size=8, grad_clip_norm=1.0))
    c.train.update(dict(steps=12, workdir=str(workdir), eval_every=0, checkpoint_every=0, progress_bars=False,
                        tensorboard=True, export_final=False))
    c.train.update(train)
    c.eval.update(dict(k=1, greedy=True, batch_tasks=8))
    return c


def test_reward_rises_and_observability_files_exist(tiny_dir, tmp_path):
    from agentgym_jax.trainer import Trainer

    trainer = Trainer(tiny_config(tiny_dir, tmp_path, steps=16))
    try:
        history = trainer.fit()
        plot = trainer.plot()
    finally:
        trainer.close()
    scores = [m["rollout/score"] for m in history]
    assert np.mean(scores[-3:]) > np.mean(scores[:3]) + 0.25, scores
    assert np.mean(scores[-3:]) > 0.8, scores
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 17))
    for key in ("time/sampling_s", "time/env_s", "time/train_s", "train/grad_norm", "rollout/end_done", "horizon"):
        assert key in rows[0], key
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    sample = json.loads((tmp_path / "trajectories.jsonl").read_text().splitlines()[0])
    assert sample["messages"][0]["role"] == "system" and sample["end_reason"] == "done"
    assert plot.is_file() and plot.stat().st_size > 10_000
    # The sampler compiled a bounded number of programs over 16 steps of rollouts.
    assert rows[-1]["sampler/compilations"] <= 4


def test_weights_are_packed_once_per_update_and_freed_before_it(tiny_dir, tmp_path, monkeypatch):
    from agentgym_jax import sampling
    from agentgym_jax.trainer import Trainer

    packs, generate_calls, packed_at_update = [], [], []
    pack_program, generate = sampling.pack_program, sampling.Sampler.generate
    monkeypatch.setattr(sampling, "pack_program", lambda *a, **k: packs.append(1) or pack_program(*a, **k))
    monkeypatch.setattr(sampling.Sampler, "generate",
                        lambda self, *a, **k: generate_calls.append(1) or generate(self, *a, **k))
    trainer = Trainer(tiny_config(tiny_dir, tmp_path, steps=2))
    update = trainer.learner.update
    monkeypatch.setattr(trainer.learner, "update",
                        lambda *a, **k: packed_at_update.append(trainer.sampler._packed) or update(*a, **k))
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert len(generate_calls) >= 4  # two-turn episodes: at least two calls a step
    assert len(packs) == 2 and packed_at_update == [None, None]  # one pack per parameter version, freed for updates


def test_environment_tokens_are_masked_in_a_real_batch(tiny_dir, tmp_path):
    import jax

    from agentgym_jax.trajectory_packing import pack_trajectories
    from agentgym_jax.trainer import LENGTH_BUCKETS, Trainer

    trainer = Trainer(tiny_config(tiny_dir, tmp_path))
    try:
        tasks = trainer.tasks_for_step(1)
        trajectories, _ = trainer.rollout(tasks, 2, horizon=2, rng=jax.random.PRNGKey(0))
        chat = trainer.chat
    finally:
        trainer.close()
    arrays = pack_trajectories(trajectories, LENGTH_BUCKETS)
    for t in trajectories:
        mask = np.asarray(t.loss_mask)
        tokens = np.asarray(t.tokens)
        assert t.turns == 2 and mask.sum() > 0
        # Masked-in tokens are exactly the sampled ones: their log-probs are non-zero, everything else is 0.
        assert np.all((np.asarray(t.logprobs) != 0) == (mask == 1))
        # Observation text appears only in masked-out (environment) tokens.
        agent_text = chat.decode(tokens[mask == 1])
        assert "Another word" not in agent_text and "Turn 1 noted" in chat.decode(tokens[mask == 0])
    assert arrays.loss_mask[:, 0].sum() == 0


def test_kill_and_resume_reproduces_the_uninterrupted_run(tiny_dir, tmp_path):
    from agentgym_jax.trainer import Trainer

    straight = Trainer(tiny_config(tiny_dir, tmp_path / "straight", steps=4))
    try:
        expected = straight.fit()
    finally:
        straight.close()
    first = Trainer(tiny_config(tiny_dir, tmp_path / "resumed", steps=4, checkpoint_every=1))
    try:
        first.fit(steps=2)  # "killed" after step 2
    finally:
        first.close()
    second = Trainer(tiny_config(tiny_dir, tmp_path / "resumed", steps=4, checkpoint_every=1))
    try:
        assert second.maybe_resume() and second.step == 2
        resumed = second.fit()
    finally:
        second.close()
    for key in ("rollout/score", "train/policy_loss", "train/grad_norm", "horizon"):
        assert resumed[-1][key] == pytest.approx(expected[-1][key], rel=1e-6, abs=1e-7), key


def test_corrupt_latest_checkpoint_falls_back_to_previous(tiny_dir, tmp_path):
    from agentgym_jax.trainer import Trainer

    trainer = Trainer(tiny_config(tiny_dir, tmp_path, steps=2, checkpoint_every=1))
    try:
        trainer.fit()
    finally:
        trainer.close()
    latest = tmp_path / "checkpoints" / "2"
    for f in latest.rglob("*"):
        if f.is_file() and f.suffix not in (".json",):
            f.write_bytes(b"garbage")
    again = Trainer(tiny_config(tiny_dir, tmp_path, steps=2, checkpoint_every=1))
    try:
        assert again.maybe_resume()
        assert again.step == 1 and again.checkpointer.skipped == [2]  # launch.eval/export_hf print both
    finally:
        again.close()


@pytest.mark.parametrize("override,match", [
    (dict(horizon=dict(turns=-2)), "horizon.turns"),
    (dict(data=dict(samples_per_task=1)), "data.samples_per_task"),
    (dict(model=dict(path="/nonexistent/model")), "model.path"),
    (dict(algo=dict(advantage_estimator="ppo2")), "advantage_estimator"),
    (dict(env=dict(name="nethack")), "env.name"),
    (dict(rollout=dict(async_env_steps=True)), "rollout.async_env_steps"),
])
def test_bad_configs_fail_before_compilation_naming_the_key(tiny_dir, tmp_path, override, match):
    config = tiny_config(tiny_dir, tmp_path)
    for section, values in override.items():
        config[section].update(values)
    with pytest.raises(ConfigError, match=match):
        validate_run_config(config)


def test_launcher_rejects_unknown_key_with_a_clear_message(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config=configs/cpu_demo.py", "--config.algo.learning_rat=1e-3",
         f"--workdir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "learning_rat" in result.stderr


def test_exported_policy_loads_in_transformers_and_generates_like_our_sampler(tiny_dir, tmp_path):
    import jax
    import torch
    import transformers

    from agentgym_jax.sampling import SamplingParams
    from agentgym_jax.trainer import Trainer

    trainer = Trainer(tiny_config(tiny_dir, tmp_path, steps=2))
    try:
        trainer.fit()
        out = trainer.export(tmp_path / "export")
        prompt = trainer.chat.render([{"role": "user", "content": "Task 3: say a word."}], add_generation_prompt=True)
        ids = [int(i) for i in prompt.ids]
        state = trainer.sampler.new_state(1)
        _, result = trainer.sampler.generate(state, [ids], jax.random.PRNGKey(0),
                                             SamplingParams(temperature=0.0, max_new_tokens=12))
    finally:
        trainer.close()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template
    stops = set(trainer.chat.stop_token_ids)
    expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                              eos_token_id=sorted(stops), pad_token_id=0)[0, len(ids):].tolist()
    assert result.tokens[0] == expected
