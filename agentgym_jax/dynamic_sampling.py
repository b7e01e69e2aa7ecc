"""Dynamic sampling (as in DAPO): fill a step's batch with groups that carry a learning signal.

A group (the samples of one task) whose scores are all equal gets zero group-relative advantage, so it adds
compute but no gradient. With dynamic sampling a step plays its tasks plus some over-sampled ones, keeps only
the groups with differing scores, and plays further freshly drawn tasks until ``target`` groups are kept or
``max_rounds`` rounds have been played. Everything drawn is a pure function of the caller's ``draw``, so a
resumed run draws the same tasks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from agentgym_jax.diagnostics import groups_of, has_signal


@dataclasses.dataclass
class SignalBatch:
    """What :func:`collect_groups_with_signal` returns."""

    kept: list[Any]  # trajectories of the kept groups (at most ``target`` groups), group ids unique
    played: list[Any]  # every trajectory played this step, kept or not
    rounds: int  # rollout rounds played
    groups_played: int
    groups_kept: int


def collect_groups_with_signal(
    play: Callable[[Sequence[Any], int], list[Any]],
    first_tasks: Sequence[Any],
    draw: Callable[[int, int], list[Any]],
    target: int,
    max_rounds: int,
    oversample: float = 1.0,
) -> SignalBatch:
    """Plays rounds of tasks until ``target`` groups with signal are kept or ``max_rounds`` rounds are played.

    Args:
        play: ``play(tasks, round)`` plays every task's group and returns trajectories whose ``group_id`` numbers
            the tasks from 0 in the order given.
        first_tasks: the step's own tasks, played in round 0.
        draw: ``draw(round, count)`` returns ``count`` further tasks for ``round`` (deterministic).
        target: groups wanted (normally the step's tasks per step).
        max_rounds: the most rounds to play (>= 1); fewer than ``target`` groups may come back.
        oversample: tasks drawn per missing group (>= 1); round 0 adds ``ceil(target * (oversample - 1))``
            drawn tasks to ``first_tasks``.
    """
    if target < 1:
        raise ValueError(f"target must be >= 1, got {target}")
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    if oversample < 1:
        raise ValueError(f"oversample must be >= 1, got {oversample}")
    kept: list[Any] = []
    played: list[Any] = []
    groups_played = groups_kept = 0
    next_group = 0
    rounds = 0
    tasks = list(first_tasks) + list(draw(0, math.ceil(target * (oversample - 1))))
    while True:
        trajectories = play(tasks, rounds)
        rounds += 1
        for trajectory in trajectories:
            trajectory.group_id += next_group
        next_group += len(tasks)
        played += trajectories
        for group in groups_of(trajectories).values():
            groups_played += 1
            if has_signal(group) and groups_kept < target:
                kept += group
                groups_kept += 1
        missing = target - groups_kept
        if missing == 0 or rounds >= max_rounds:
            break
        tasks = list(draw(rounds, math.ceil(missing * oversample)))
    return SignalBatch(kept=kept, played=played, rounds=rounds, groups_played=groups_played,
                       groups_kept=groups_kept)
