"""Horizon schedules (ScalingInter-RL), evaluation metrics and the Wilson interval."""

import math

import pytest

from agentgym_jax import evaluation, schedule
from agentgym_jax.errors import ConfigError
from agentgym_jax.rollout import Trajectory


def test_fixed_schedule():
    config = {"type": "fixed", "turns": 20}
    assert [schedule.horizon_at(config, s) for s in (1, 50, 1000)] == [20, 20, 20]
    assert schedule.max_horizon(config) == 20


def test_stepwise_matches_the_original_babyai_script():
    # Original: rounds [6, 13, 20] every 100 steps; steps 1..100 -> 6, 101..200 -> 13, 201+ -> 20.
    config = {"type": "stepwise", "rounds": (6, 13, 20), "steps_per_stage": 100}
    expected = {1: 6, 100: 6, 101: 13, 200: 13, 201: 20, 5000: 20}
    assert {s: schedule.horizon_at(config, s) for s in expected} == expected


def test_stepwise_with_explicit_starts():
    config = {"type": "stepwise", "rounds": (4, 8, 12), "stage_starts": (1, 11, 31)}
    assert [schedule.horizon_at(config, s) for s in (1, 10, 11, 30, 31, 99)] == [4, 4, 8, 8, 12, 12]


def test_linear_growth_capped():
    config = {"type": "linear", "start": 5, "end": 10, "increment": 2, "steps_per_stage": 10}
    assert [schedule.horizon_at(config, s) for s in (1, 10, 11, 21, 31, 41, 500)] == [5, 5, 7, 9, 10, 10, 10]
    assert schedule.max_horizon(config) == 10


def test_resume_gets_the_uninterrupted_horizon():
    # A pure function of the step: the original's resume is off by one at stage boundaries; ours cannot be.
    config = {"type": "stepwise", "rounds": (6, 13, 20), "steps_per_stage": 100}
    uninterrupted = [schedule.horizon_at(config, s) for s in range(1, 301)]
    resumed_at = 100
    resumed = uninterrupted[:resumed_at] + [schedule.horizon_at(config, s) for s in range(resumed_at + 1, 301)]
    assert resumed == uninterrupted and uninterrupted[100] == 13


@pytest.mark.parametrize("config,match", [
    ({"type": "fixed", "turns": -3}, "horizon.turns must be a positive integer"),
    ({"type": "fixed", "turns": 0}, "horizon.turns"),
    ({"type": "stepwise", "rounds": (), "steps_per_stage": 10}, "non-empty list"),
    ({"type": "stepwise", "rounds": (2, 4), "stage_starts": (1,)}, "stage_starts"),
    ({"type": "linear", "start": 9, "end": 3, "increment": 1, "steps_per_stage": 2}, "horizon.end"),
    ({"type": "exponential"}, "horizon.type must be one of"),
])
def test_bad_schedules_name_the_key(config, match):
    with pytest.raises(ConfigError, match=match):
        schedule.validate_schedule(config)


def test_wilson_interval_known_values():
    low, high = evaluation.wilson_interval(8, 10)
    assert math.isclose(low, 0.4901625, abs_tol=1e-6) and math.isclose(high, 0.9433178, abs_tol=1e-6)
    assert evaluation.wilson_interval(0, 20)[0] == 0.0
    assert math.isclose(evaluation.wilson_interval(0, 20)[1], 0.1611252, abs_tol=1e-6)


def test_avg_and_pass_at_k_per_subtask():
    def traj(task, subtask, score, success):
        return Trajectory(task_id=task, group_id=task, subtask=subtask, score=score, success=success, turns=2)

    trajectories = [
        traj(0, "GoTo", 0.9, True), traj(0, "GoTo", 0.0, False),
        traj(1, "GoTo", 0.0, False), traj(1, "GoTo", 0.0, False),
        traj(2, "Pickup", 0.5, True), traj(2, "Pickup", 0.7, True),
    ]
    summary = evaluation.summarize(trajectories, k=2)
    assert summary["overall"]["pass@2"] == pytest.approx(2 / 3)
    assert summary["overall"]["avg@2"] == pytest.approx(2.1 / 6)
    assert summary["subtasks"]["GoTo"]["pass@2"] == pytest.approx(0.5)
    assert summary["subtasks"]["Pickup"]["avg@2"] == pytest.approx(0.6)
    table = evaluation.markdown_table(summary)
    assert "| GoTo | 2 | 0.225 | 0.500 |" in table and "**overall**" in table
