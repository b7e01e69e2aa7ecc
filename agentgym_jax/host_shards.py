"""How a multi-process run splits a step's episodes over processes and puts the pieces back together.

Every process plays a contiguous, equal share of the step's tasks (all samples of a task on one process, so an
advantage group never straddles hosts), keys each episode by its global index (the same tokens whichever process
plays it), packs its own trajectories into its rows of the global batch, and exchanges only summaries (scores,
counts, end reasons) for metrics and evaluation reports. With one process each function reduces to the
single-process behaviour.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from agentgym_jax import distributed
from agentgym_jax.batch import TrajectoryBatch
from agentgym_jax.buckets import bucket
from agentgym_jax.rollout import RolloutStats, Trajectory
from agentgym_jax.trajectory_packing import pack_trajectories


@dataclasses.dataclass(frozen=True)
class EpisodeShare:
    """This process's episodes of a rollout call: its tasks, their global group ids and its first episode's
    global index."""

    tasks: list[Any]
    group_ids: list[int]
    episode_offset: int


def episode_share(tasks: Sequence[Any], samples: int, what: str = "tasks per step") -> EpisodeShare:
    """This process's share of ``tasks`` (each played ``samples`` times); group ids number the global tasks."""
    mine = distributed.share(list(range(len(tasks))), what)
    first = mine[0] if mine else 0
    return EpisodeShare(tasks=[tasks[i] for i in mine for _ in range(samples)],
                        group_ids=[i for i in mine for _ in range(samples)], episode_offset=first * samples)


def pack_local_batch(trajectories: Sequence[Trajectory], length_buckets: Sequence[int], batch_multiple: int,
                     pad_id: int) -> TrajectoryBatch:
    """This process's rows of the step's global batch: the same row count and length on every process (the row
    count a multiple of this process's part of ``batch_multiple``), padding rows with group ids no process uses."""
    processes = distributed.process_count()
    if processes == 1:
        return pack_trajectories(trajectories, length_buckets, batch_multiple=batch_multiple, pad_id=pad_id)
    local_multiple = max(1, batch_multiple // processes)
    shape = (len(trajectories), max((len(t.tokens) for t in trajectories), default=1),
             max((t.group_id for t in trajectories), default=-1))
    shapes = distributed.allgather(shape, "batch shape")
    most = max(count for count, _, _ in shapes)
    rows = -(-max(most, 1) // local_multiple) * local_multiple
    length = bucket(max(longest for _, longest, _ in shapes), length_buckets)
    first_padding_group = max(group for _, _, group in shapes) + 1 + distributed.process_index() * rows
    return pack_trajectories(trajectories, length_buckets, pad_id=pad_id, rows=rows, length=length,
                             first_padding_group=first_padding_group)


def summary(trajectory: Trajectory) -> Trajectory:
    """A copy without the per-token log-probs, turn ids, messages and state keys (what metrics never read)."""
    return dataclasses.replace(trajectory, logprobs=[], turn_ids=[], messages=[], state_keys=[])


def gather_rollout(trajectories: Sequence[Trajectory], stats: RolloutStats) -> tuple[list[Trajectory], RolloutStats]:
    """Every process's trajectories as :func:`summary` copies (in process order) and their
    :func:`combine_stats`; the arguments themselves with one process."""
    if distributed.process_count() == 1:
        return list(trajectories), stats
    parts = distributed.allgather((stats, [summary(t) for t in trajectories]), "rollout summaries")
    return [t for _, part in parts for t in part], combine_stats([part_stats for part_stats, _ in parts])


def gather_all(trajectories: Sequence[Trajectory], what: str) -> list[Trajectory]:
    """Every process's full trajectories in process order (for evaluation files, written once)."""
    if distributed.process_count() == 1:
        return list(trajectories)
    return [t for part in distributed.allgather(list(trajectories), what) for t in part]


def combine_stats(parts: Sequence[RolloutStats]) -> RolloutStats:
    """Counts summed over processes; times of the slowest process (the step waits for it)."""
    return RolloutStats(sampling_s=max(p.sampling_s for p in parts), env_s=max(p.env_s for p in parts),
                        host_s=max(p.host_s for p in parts), generated_tokens=sum(p.generated_tokens for p in parts),
                        env_steps=sum(p.env_steps for p in parts), rounds=max(p.rounds for p in parts))
