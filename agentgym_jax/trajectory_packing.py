"""Trajectories to the learner's batch: right-padded rows with masks, old log-probs, per-turn rewards and states."""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from agentgym_jax.batch import TrajectoryBatch
from agentgym_jax.buckets import bucket
from agentgym_jax.errors import ConfigError
from agentgym_jax.rollout import Trajectory


def pack_trajectories(
    trajectories: Sequence[Trajectory], length_buckets: Sequence[int], batch_multiple: int = 1, pad_id: int = 0,
    rows: int | None = None, length: int | None = None, first_padding_group: int | None = None,
) -> TrajectoryBatch:
    """Right-pads trajectories into the learner's :class:`TrajectoryBatch`, T and B rounded up (B to a multiple of
    ``batch_multiple``), with per-turn rewards and state ids for step-level estimators. ``rows`` and ``length``
    fix B and T instead (a process's part of a multi-process batch).

    Padding rows have ``valid == 0`` and an all-zero mask; their group ids (from ``first_padding_group``, default
    one past the largest real id) are fresh so they never join a real group. State keys become int32 ids
    (CRC-32), compared only within a group.
    """
    if length is None:
        if not trajectories:
            raise ConfigError("no trajectories to pack")
        length = bucket(max(len(t.tokens) for t in trajectories), length_buckets)
    if rows is None:
        rows = -(-len(trajectories) // batch_multiple) * batch_multiple
    if rows < len(trajectories) or any(len(t.tokens) > length for t in trajectories):
        raise ConfigError(f"{len(trajectories)} trajectories do not fit {rows} rows of {length} tokens")
    steps = max(1, max((t.turns for t in trajectories), default=1))
    tokens = np.full((rows, length), pad_id, np.int32)
    loss_mask = np.zeros((rows, length), np.float32)
    old_logp = np.zeros((rows, length), np.float32)
    turn_ids = np.full((rows, length), -1, np.int32)
    scores = np.zeros((rows,), np.float32)
    valid = np.zeros((rows,), np.float32)
    step_rewards = np.zeros((rows, steps), np.float32)
    step_states = np.full((rows, steps), -1, np.int32)
    if first_padding_group is None:
        first_padding_group = max(t.group_id for t in trajectories) + 1
    group_ids = np.arange(rows, dtype=np.int32) + first_padding_group
    for b, t in enumerate(trajectories):
        n = len(t.tokens)
        tokens[b, :n] = t.tokens
        loss_mask[b, :n] = t.loss_mask
        old_logp[b, :n] = t.logprobs
        turn_ids[b, :n] = t.turn_ids
        scores[b], valid[b], group_ids[b] = t.score, 1.0, t.group_id
        acted = min(t.turns, len(t.state_keys))
        step_rewards[b, : len(t.step_rewards[:acted])] = t.step_rewards[:acted]
        step_states[b, :acted] = [zlib.crc32(key.encode()) & 0x7FFFFFFF for key in t.state_keys[:acted]]
    return TrajectoryBatch.create(tokens, loss_mask, scores, group_ids, old_logp=old_logp, valid=valid,
                                  turn_ids=turn_ids, step_rewards=step_rewards, step_states=step_states)
