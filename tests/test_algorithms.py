"""Algorithms as plug-ins: GiGPO's step groups, GSPO and CISPO against hand computation, one source of truth for
settings, a user's estimator registered from outside and trained through launch.train, per-turn rollout data."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import advantages as adv
from agentgym_jax import losses
from agentgym_jax.errors import ConfigError
from agentgym_jax.learner_config import NOT_IN_RUN_CONFIG, LearnerConfig, from_run_config_section
from agentgym_jax.run_config import base_config

REPO = Path(__file__).resolve().parents[1]
f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
S = 1 / math.sqrt(2)  # (x - mean) / unbiased std for a pair of values


def _gigpo_batch():
    """Group 7: A succeeds in 2 turns (states s0, s1), B fails in 3 (s0, s2, s1); group 9: C, 1 turn in s0.

    Agent tokens: A has turn 0 at t=1-2 and turn 1 at t=4; B turns at t=1, t=3, t=5; C at t=1.
    """
    mask = np.zeros((3, 7), np.float32)
    turns = np.full((3, 7), -1, np.int32)
    for row, spans in enumerate([[(1, 3, 0), (4, 5, 1)], [(1, 2, 0), (3, 4, 1), (5, 6, 2)], [(1, 2, 0)]]):
        for start, end, turn in spans:
            mask[row, start:end], turns[row, start:end] = 1, turn
    s0, s1, s2 = 11, 22, 33
    return dict(
        scores=f32([1.0, 0.0, 0.5]), loss_mask=f32(mask), group_ids=jnp.asarray([7, 7, 9]), turn_ids=jnp.asarray(turns),
        step_rewards=f32([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]]),
        step_states=jnp.asarray([[s0, s1, -1], [s0, s2, s1], [s0, -1, -1]], jnp.int32),
    ), mask


def test_gigpo_step_groups_by_hand():
    batch, mask = _gigpo_batch()
    a, returns = adv.compute_advantages("gigpo", step_gamma=0.5, step_weight=1.0, std_eps=0.0, **batch)
    # Episode level: A, B = +-S (pair normalized by its unbiased std); C alone: its score 0.5.
    # Step returns with gamma 0.5: A [0.5, 1], B [0, 0, 0], C [0.5].
    # s0: A 0.5 vs B 0 -> +-S; s1: A 1 (turn 1) vs B 0 (turn 2) -> +-S; s2 (B turn 1) alone -> 0; C's s0 is in
    # another episode group, so it is alone -> 0.
    expected = np.zeros((3, 7), np.float32)
    expected[0, 1:3], expected[0, 4] = 2 * S, 2 * S
    expected[1, 1], expected[1, 3], expected[1, 5] = -2 * S, -S, -2 * S
    expected[2, 1] = 0.5
    np.testing.assert_allclose(np.asarray(a), expected, atol=1e-6)
    np.testing.assert_allclose(np.asarray(returns)[0, [1, 2, 4]], [0.5, 0.5, 1.0], atol=1e-6)
    centered, _ = adv.compute_advantages("gigpo", step_gamma=0.5, normalize_std=False, **batch)
    expected_centered = np.zeros((3, 7), np.float32)
    expected_centered[0, 1:3], expected_centered[0, 4] = 0.5 + 0.25, 0.5 + 0.5
    expected_centered[1, 1], expected_centered[1, 3], expected_centered[1, 5] = -0.5 - 0.25, -0.5, -0.5 - 0.5
    expected_centered[2, 1] = 0.5
    np.testing.assert_allclose(np.asarray(centered), expected_centered, atol=1e-6)
    assert np.all(np.asarray(a)[mask == 0] == 0)


def test_gspo_uses_one_clipped_ratio_per_trajectory():
    mask = f32([[0, 1, 1], [0, 1, 1], [0, 1, 1]])
    old = f32(np.zeros((3, 3)))
    logp = f32([[0, 0.2, -0.1], [0, -0.001, 0.0], [0, 1e-4, 0.0]])
    adv_ = f32([[0, 1, 1], [0, -1, -1], [0, 1, 1]])
    out = losses.gspo_loss(logp, old, adv_, mask)
    ratio = np.asarray(out.ratio)
    np.testing.assert_allclose(ratio[:, 1:], np.exp([[0.05] * 2, [-0.0005] * 2, [5e-5] * 2]), rtol=1e-6)
    loss = np.asarray(out.loss)[:, 1:]
    np.testing.assert_allclose(loss[0], [-(1 + 4e-4)] * 2, rtol=1e-6)  # above 1 + 4e-4 with A > 0: clipped
    np.testing.assert_allclose(loss[1], [1 - 3e-4] * 2, rtol=1e-6)  # below 1 - 3e-4 with A < 0: clipped
    np.testing.assert_allclose(loss[2], [-math.exp(5e-5)] * 2, rtol=1e-6)  # inside: the surrogate
    assert np.asarray(out.clipped)[:, 1:].tolist() == [[1, 1], [1, 1], [0, 0]]
    grad = jax.grad(lambda lp: jnp.sum(losses.gspo_loss(lp, old, adv_, mask).loss[2]))(logp)
    np.testing.assert_allclose(np.asarray(grad)[2, 1:], [-math.exp(5e-5)] * 2, rtol=1e-6)  # -A * s per token
    assert np.all(np.asarray(grad)[:2] == 0)  # clipped rows carry no gradient


def test_cispo_clips_the_detached_weight_not_the_update():
    logp, old, a = f32([[-1.0, -2.0, -0.5]]), f32([[-1.5, -4.0, -0.5]]), f32([[2.0, 2.0, -1.0]])
    out = losses.cispo_loss(logp, old, a)
    weights = [math.exp(0.5), 5.0, 1.0]  # exp(2) = 7.39 is capped at 1 + 4
    np.testing.assert_allclose(np.asarray(out.loss)[0], [-w * x * lp for w, x, lp in
                                                         zip(weights, [2, 2, -1], [-1, -2, -0.5])], rtol=1e-6)
    assert np.asarray(out.clipped)[0].tolist() == [0, 1, 0]
    grad = jax.grad(lambda lp: jnp.sum(losses.cispo_loss(lp, old, a).loss))(logp)
    np.testing.assert_allclose(np.asarray(grad)[0], [-w * x for w, x in zip(weights, [2, 2, -1])], rtol=1e-6)


def test_overlong_penalty_is_dapos_linear_ramp():
    np.testing.assert_allclose(adv.overlong_penalty(np.array([10, 80, 90, 100, 150]), 100, 20, 1.0),
                               [0, 0, 0.5, 1.0, 1.0])


def test_every_algo_setting_has_one_default_and_options_are_checked():
    section = base_config().algo
    fields = {f.name: f for f in dataclasses.fields(LearnerConfig) if f.name not in NOT_IN_RUN_CONFIG}
    assert set(section) == set(fields)
    defaults = LearnerConfig()
    for name in fields:
        value = section[name]
        value = value.to_dict() if hasattr(value, "to_dict") else value
        assert value == getattr(defaults, name), name
    section.minibatch_size = 64  # a None default is a typed reference, so it takes an int
    assert from_run_config_section(section).minibatch_size == 64
    section.estimator_options = {"normalize_std": False}
    assert from_run_config_section(section).resolved_estimator_options()["normalize_std"] is False
    section.estimator_options = {"lambda": 0.9}
    with pytest.raises(ConfigError, match=r"algo.estimator_options: advantage estimator 'grpo' has no option"):
        from_run_config_section(section)
    section.estimator_options = {}
    section.policy_loss, section.loss_options = "gspo", {"seq_clip_high": 1e-3}
    assert from_run_config_section(section).resolved_loss_options() == {"seq_clip_low": 3e-4, "seq_clip_high": 1e-3}
    section.policy_loss = "ppo2"
    with pytest.raises(ConfigError, match="unknown policy loss 'ppo2'; registered: cispo, gspo, ppo_clip"):
        from_run_config_section(section)


def test_a_users_estimator_trains_through_launch_train(tmp_path):
    from tests.tiny_models import save_tiny_chat_model

    model = save_tiny_chat_model(tmp_path / "model")
    config_file = tmp_path / "config.py"
    config_file.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom tests.test_trainer import tiny_config\n\n"
        f"def get_config():\n    return tiny_config({str(model)!r}, {str(tmp_path / 'run')!r}, steps=2, "
        "eval_before=False, export_final=False)\n")
    command = [sys.executable, "-m", "launch.train", f"--config={config_file}",
               "--config.algo.import_modules=('tests.toy_estimator',)",
               "--config.algo.advantage_estimator=toy_constant", "--config.data.test_tasks=0"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # the toy gives every agent token advantage 0.5: no built-in estimator does that
        assert row["train/advantages/min"] == row["train/advantages/max"] == 0.5
    unknown = subprocess.run(command[:4] + ["--config.algo.advantage_estimator=toy_constant"], cwd=REPO,
                             capture_output=True, text=True, timeout=600)
    assert unknown.returncode != 0 and "unknown advantage estimator 'toy_constant'" in unknown.stderr.lower() \
        and "algo.import_modules" in unknown.stderr
    assert "Traceback" not in unknown.stderr


def test_rollout_batches_carry_turns_rewards_and_states(tmp_path):
    from agentgym_jax.rollout import Trajectory
    from agentgym_jax.trajectory_packing import pack_trajectories

    t = Trajectory(task_id=0, group_id=3, subtask="x")
    t.append([1, 2], 0)
    t.append([5, 6], 1, [-0.1, -0.2], turn=0)
    t.append([3], 0)
    t.append([7], 1, [-0.3], turn=1)
    t.turns, t.score, t.step_rewards, t.state_keys = 2, 1.0, [0.25, 0.75], ["start", "observation:after"]
    batch = pack_trajectories([t, dataclasses.replace(t, group_id=3, state_keys=["start", "elsewhere"])], (8,))
    assert batch.turn_ids[0].tolist() == [-1, -1, 0, 0, -1, 1, -1, -1]
    assert batch.step_rewards.tolist() == [[0.25, 0.75], [0.25, 0.75]]
    states = batch.step_states
    assert states[0, 0] == states[1, 0] and states[0, 1] != states[1, 1] and (states >= 0).all()


@pytest.mark.parametrize("env_name, same, changes", [
    ("textcraft", ["Action:\ninventory"], "Action:\nget 1 oak logs"),
    ("babyai", ["Action:\nturn left", "Action:\nturn right"], "Action:\nturn left"),
    ("sciworld", ["Action:\nlook around"], "Action:\nopen door to kitchen"),
])
def test_environments_name_their_state_for_step_groups(env_name, same, changes):
    from environments.base import make_env

    env = make_env(env_name)
    try:
        _, info = env.reset(0)
        key = info["state_key"]
        for turn in same:  # actions that leave the state as it was (or restore it)
            last = env.step(turn)
        assert last.info["state_key"] == key
        assert env.step(changes).info["state_key"] != key
        assert env.reset(0)[1]["state_key"] == key  # a function of the state, not of the history
    finally:
        env.close()


def test_gigpo_trains_through_the_trainer(tmp_path):
    from agentgym_jax.trainer import Trainer
    from tests.test_trainer import tiny_config
    from tests.tiny_models import save_tiny_chat_model

    config = tiny_config(save_tiny_chat_model(tmp_path / "model"), tmp_path / "run", steps=3)
    config.algo.advantage_estimator = "gigpo"
    config.algo.estimator_options = {"step_gamma": 0.9}
    trainer = Trainer(config)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    assert len(history) == 3
    for row in history:
        assert row["train/skipped_updates"] == 0 and np.isfinite(row["train/total_loss"])
        assert row["train/advantages/abs_mean"] > 0 and row["train/optimizer_updates"] >= 1
