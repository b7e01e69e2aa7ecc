"""MiniWoB++ (offline, in a real Chromium) with GRPO, in WebArena's observation and action space.

    python -m launch.train --config=configs/miniwob_grpo.py --config.model.path=/models/Qwen2.5-1.5B-Instruct
    python -m launch.train --config=configs/miniwob_grpo.py:cpu                                 # this machine

``default``: the WebArena recipe's sizes on one accelerator (n=4, 32 tasks/step, 16-trajectory minibatches,
512 tokens per turn) with 10 turns, enough for every listed MiniWoB++ task; the observation is capped at 1024
approximate tokens (MiniWoB++ pages are small).
``cpu``: the default SmolLM2-135M, the five easiest click/type tasks, 3 turns, 2 tasks x 4 samples per step,
top 8 layers trained; a smoke-sized run for a 2-core machine (each env worker runs Chromium), not a recipe that
learns much.
"""

from agentgym_jax.run_config import base_config

EASY_TASKS = ("click-test", "click-test-2", "click-button", "focus-text", "enter-text")


def get_config(variant: str = "default"):
    if variant == "cpu":
        return _cpu()
    if variant != "default":
        raise ValueError(f"unknown variant {variant!r}; use 'default' or 'cpu'")
    c = base_config()
    c.env.name, c.env.num_workers, c.env.step_timeout_s = "miniwob", 8, 120.0
    c.env.kwargs = dict(max_obs_tokens=1024)
    c.data.update(dict(tasks_per_step=32, samples_per_task=4, validation_tasks=64))
    c.algo.update(dict(minibatch_size=16, ppo_epochs=2))
    c.rollout.update(dict(max_turn_tokens=512, max_trajectory_tokens=1024 + 8192))
    c.horizon.type, c.horizon.turns = "fixed", 10
    c.model.update(dict(dtype="bfloat16", remat=True))
    c.train.workdir = "runs/miniwob_grpo"
    return c


def _cpu():
    c = base_config()
    c.env.name, c.env.num_workers, c.env.step_timeout_s = "miniwob", 1, 120.0
    c.env.kwargs = dict(tasks=EASY_TASKS, max_obs_tokens=256)
    c.data.update(dict(tasks_per_step=2, samples_per_task=4, validation_tasks=0, test_tasks=8))
    c.rollout.update(dict(max_turn_tokens=64, max_trajectory_tokens=2048, canned_reply=""))
    c.horizon.type, c.horizon.turns = "fixed", 3
    c.algo.update(dict(
        old_logp_source="sampler", learning_rate=1e-5, minibatch_size=8, microbatch_size=4,
        logprob_chunk_size=128, trainable_layers=8, kl_coef=0.0, use_reference=False))
    c.train.update(dict(steps=10, workdir="runs/miniwob_cpu", eval_every=0, checkpoint_every=10))
    c.eval.update(dict(k=1, greedy=True, batch_tasks=8, horizon=3))
    return c
