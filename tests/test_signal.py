"""RL signal: response prefixes (template glue, never trained), signal diagnostics, dynamic sampling."""

import dataclasses
import logging

import jax
import numpy as np
import pytest

from agentgym_jax import diagnostics
from agentgym_jax.dynamic_sampling import collect_groups_with_signal
from tests.test_trainer import tiny_config, tiny_dir  # noqa: F401  (fixture)

PREFIX = "Word:\n"


@dataclasses.dataclass
class FakeTrajectory:
    group_id: int
    score: float
    task: int = -1
    success: bool = False
    turns: int = 1
    judged_actions: int = 0
    valid_actions: int = 0

    @property
    def num_agent_tokens(self) -> int:
        return 3


def _play_with(scores_of):
    calls = []

    def play(tasks, round_index):
        calls.append((list(tasks), round_index))
        return [FakeTrajectory(i, s, task) for i, task in enumerate(tasks) for s in scores_of(task)]

    return play, calls


def _signal_every_third(task):
    return [1.0, 0.0, 0.0, 0.0] if task % 3 == 0 else [0.5] * 4


def test_dynamic_sampling_keeps_only_groups_with_signal_and_stops_when_full():
    play, calls = _play_with(_signal_every_third)
    draws = []

    def draw(round_index, count):
        draws.append((round_index, count))
        return [100 * (round_index + 1) + i for i in range(count)]

    out = collect_groups_with_signal(play, [0, 1, 2, 3], draw, target=2, max_rounds=3, oversample=1.5)
    assert draws == [(0, 1)]  # ceil(2 * 0.5) extra tasks in round 0, no further round needed
    assert out.rounds == 1 and out.groups_played == 5 and out.groups_kept == 2
    assert sorted({t.task for t in out.kept}) == [0, 3] and len(out.kept) == 8
    assert len(out.played) == 20


def test_dynamic_sampling_retries_are_bounded_and_group_ids_stay_unique():
    play, calls = _play_with(_signal_every_third)

    def draw(round_index, count):
        return [3 * (10 * round_index + i) + 1 for i in range(count)]  # never a multiple of 3: no signal

    out = collect_groups_with_signal(play, [1, 2, 3, 4], draw, target=3, max_rounds=3, oversample=2.0)
    assert out.rounds == 3 and [r for _, r in calls] == [0, 1, 2]
    assert out.groups_kept == 1 and {t.task for t in out.kept} == {3}
    # round 0: 4 own + ceil(3 * 1) drawn; round 1: 2 missing * 2; round 2: the same again
    assert [len(tasks) for tasks, _ in calls] == [7, 4, 4]
    assert out.groups_played == 15
    ids_by_round = [{t.group_id for t in out.played if t.task in tasks} for tasks, _ in calls]
    assert len(set().union(*ids_by_round)) == 15


def test_dynamic_sampling_with_no_signal_keeps_nothing_and_rejects_bad_settings():
    play, _ = _play_with(lambda task: [0.0, 0.0])
    out = collect_groups_with_signal(play, [1, 2], lambda r, n: list(range(n)), target=2, max_rounds=2)
    assert out.kept == [] and out.rounds == 2 and out.groups_played == 4
    for bad in (dict(target=0), dict(max_rounds=0), dict(oversample=0.5)):
        args = dict(target=2, max_rounds=2, oversample=1.0) | bad
        with pytest.raises(ValueError):
            collect_groups_with_signal(play, [1], lambda r, n: [], **args)


def test_rollout_diagnostics_and_no_signal_warning(caplog):
    trajectories = [FakeTrajectory(0, 1.0, success=True, judged_actions=2, valid_actions=1),
                    FakeTrajectory(0, 0.0, judged_actions=2, valid_actions=0),
                    FakeTrajectory(1, 0.0, judged_actions=1, valid_actions=0),
                    FakeTrajectory(1, 0.0, judged_actions=1, valid_actions=0)]
    metrics = diagnostics.rollout_diagnostics(trajectories)
    assert metrics["diag/groups_with_signal"] == 0.5
    assert metrics["diag/valid_action_rate"] == pytest.approx(1 / 6)
    assert metrics["diag/response_tokens"] == 3.0
    assert metrics["rollout/episodes"] == 4 and metrics["rollout/successes"] == 1
    monitor = diagnostics.SignalMonitor(threshold=0.1, patience=2)
    flat = {"diag/groups_with_signal": 0.0, "diag/valid_action_rate": 0.05, "rollout/success": 0.0}
    with caplog.at_level(logging.WARNING):
        assert monitor.observe(flat) is None
        message = monitor.observe(flat)
        assert monitor.observe(flat) is None  # once per streak
    assert "response_prefix" in message and "dynamic_sampling" in message and "easier task family" in message
    assert "no signal" in caplog.text


def test_response_prefix_is_glue_in_sampler_input_training_and_evaluation(tiny_dir, tmp_path):  # noqa: F811
    from agentgym_jax.trajectory_packing import pack_trajectories
    from agentgym_jax.trainer import LENGTH_BUCKETS, Trainer

    config = tiny_config(tiny_dir, tmp_path, steps=1)
    config.rollout.response_prefix = PREFIX
    config.data.update(dict(dynamic_sampling=True, dynamic_max_rounds=2))
    trainer = Trainer(config)
    try:
        chat = trainer.chat
        opening = list(chat.generation_prompt_ids) + [int(i) for i in chat.encode_in_turn(PREFIX)]
        trajectories, _ = trainer.rollout(trainer.tasks_for_step(1), 2, horizon=2, rng=jax.random.PRNGKey(0))
        summary, evaluated = trainer.evaluate(trainer.test_tasks[:2])
        metrics = trainer.train_step(1)
    finally:
        trainer.close()
    for t in trajectories + evaluated:
        tokens, mask = np.asarray(t.tokens), np.asarray(t.loss_mask)
        starts = [i for i in range(1, len(mask)) if mask[i] == 1 and mask[i - 1] == 0]
        assert len(starts) == t.turns == 2
        for start in starts:  # every agent turn is sampled right after the generation prompt + the prefix
            assert tokens[start - len(opening): start].tolist() == opening
            assert not mask[start - len(opening): start].any()
        replies = [m["content"] for m in t.messages if m["role"] == "assistant"]
        assert len(replies) == 2 and all(r.startswith(PREFIX) for r in replies)
    arrays = pack_trajectories(trajectories, LENGTH_BUCKETS)
    prefix_ids = chat.encode_in_turn(PREFIX)
    for row, t in enumerate(trajectories):
        first = t.loss_mask.index(1)
        assert arrays.tokens[row, first - len(prefix_ids): first].tolist() == list(prefix_ids)
        assert arrays.loss_mask[row, first - len(prefix_ids): first].sum() == 0
    assert summary["settings"]["response_prefix"] == PREFIX and summary["settings"]["greedy"] is True
    for key in ("diag/groups_with_signal", "diag/response_tokens", "dynamic/rounds", "dynamic/groups_kept",
                "rollout/episodes"):
        assert key in metrics, key
    assert 1 <= metrics["dynamic/rounds"] <= 2
    if "train/policy_loss" in metrics:  # an update ran: the first minibatch is scored at the sampling parameters
        assert metrics["diag/first_ratio"] == pytest.approx(1.0, abs=1e-3)
        assert metrics["diag/first_abs_logp_gap"] < 1e-3
