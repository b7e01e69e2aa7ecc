"""Packed learner rows: one copy of a group's shared prompt, several trajectories per row, no padding to a bucket.

The samples of one task share their prompt, often most of their tokens. A *block* holds a group's shared prefix
(the members' common tokens before any member's first agent token) once, then each member's own remaining tokens
(its *branch*), cut after its last agent token (later tokens never affect the loss). Blocks are packed into rows
first-fit. Token ``t`` of a trajectory keeps RoPE position ``t`` and attends to its block's prefix and to the
earlier tokens of its own branch (:class:`agentgym_jax.model.Segments`), so every agent token is scored from exactly
the context it has in its own padded row: the loss and gradients equal the padded layout's for token-level losses
with token-mean aggregation, at a fraction of the tokens (a group of 4 one-turn episodes with a 250-token prompt and
10-token actions: 290 tokens instead of 4 x 256).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from agentgym_jax.buckets import LENGTH_BUCKETS
from agentgym_jax.policy_objective import TrainingBatch, agent_positions

PER_TOKEN_FIELDS = ("loss_mask", "old_logp", "advantages", "returns", "ref_logp", "old_values", "trunk")


@dataclasses.dataclass(frozen=True)
class Block:
    """Members (trajectory indices) sharing ``prefix`` tokens, each packed up to its own ``end``."""

    prefix: int
    members: tuple[int, ...]
    ends: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.prefix + sum(end - self.prefix for end in self.ends)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Packed rows [R, L] and where each trajectory token went."""

    tokens: np.ndarray
    rope_positions: np.ndarray
    blocks: np.ndarray  # block id within the row, -1 on padding
    branches: np.ndarray  # 0 on a block's shared prefix (and padding), k > 0 on its k-th member's own tokens
    source_cols: np.ndarray  # column of the state that predicts each cell's token, -1 when none
    cells: np.ndarray  # [N, T] flat index (row * L + column) of trajectory n's token t, -1 when not packed

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape


def _blocks(tokens: np.ndarray, loss_mask: np.ndarray, group_ids: np.ndarray, max_length: int) -> list[Block]:
    on = loss_mask > 0
    scored = on.any(axis=1)
    ends = np.where(scored, on.shape[1] - np.argmax(on[:, ::-1], axis=1), 0)
    firsts = np.argmax(on, axis=1)
    blocks: list[Block] = []
    order = {g: i for i, g in reversed(list(enumerate(group_ids)))}  # groups in order of first appearance
    for group in sorted({int(g) for g in group_ids[scored]}, key=lambda g: order[g]):
        members = [int(n) for n in np.flatnonzero(scored & (group_ids == group))]
        prefix = int(firsts[members].min())
        same = (tokens[members, :prefix] == tokens[members[0], :prefix]).all(axis=0)
        prefix = prefix if same.all() else int(np.argmin(same))
        current: list[int] = []
        for n in members:  # a block longer than max_length is split, each part with its own copy of the prefix
            if current and prefix + sum(ends[m] - prefix for m in current + [n]) > max_length:
                blocks.append(Block(prefix, tuple(current), tuple(int(ends[m]) for m in current)))
                current = []
            current.append(n)
        blocks.append(Block(prefix, tuple(current), tuple(int(ends[m]) for m in current)))
    return blocks


def plan(tokens: np.ndarray, loss_mask: np.ndarray, group_ids: np.ndarray,
         length_buckets: Sequence[int] = LENGTH_BUCKETS, max_block: int | None = None) -> Layout:
    """Packs trajectories ``tokens`` [N, T] (rows without agent tokens are left out) into rows whose length is
    the bucket of the longest block; a group whose block would exceed ``max_block`` (default ``T``) is split
    into several blocks, each with its own copy of the prefix."""
    tokens, group_ids = np.asarray(tokens), np.asarray(group_ids)
    n, width = tokens.shape
    blocks = sorted(_blocks(tokens, np.asarray(loss_mask), group_ids, max_block or width), key=lambda b: -b.size)
    longest = max((b.size for b in blocks), default=1)
    fitting = [b for b in length_buckets if b >= longest]
    length = min(fitting) if fitting else longest
    rows: list[list[Block]] = []
    room: list[int] = []
    for block in blocks:  # first-fit decreasing
        row = next((r for r, free in enumerate(room) if free >= block.size), None)
        if row is None:
            rows.append([])
            room.append(length)
            row = len(rows) - 1
        rows[row].append(block)
        room[row] -= block.size
    shape = (max(1, len(rows)), length)
    out = Layout(tokens=np.zeros(shape, np.int32), rope_positions=np.zeros(shape, np.int32),
                 blocks=np.full(shape, -1, np.int32), branches=np.zeros(shape, np.int32),
                 source_cols=np.full(shape, -1, np.int32), cells=np.full((n, width), -1, np.int64))
    for r, row_blocks in enumerate(rows):
        col = 0
        for block_id, block in enumerate(row_blocks):
            p, first = block.prefix, block.members[0]
            span = slice(col, col + p)
            out.tokens[r, span] = tokens[first, :p]
            out.rope_positions[r, span] = np.arange(p)
            out.blocks[r, span] = block_id
            out.source_cols[r, span] = np.arange(col - 1, col + p - 1)
            if p:
                out.source_cols[r, col] = -1
            for member in block.members:
                out.cells[member, :p] = r * length + np.arange(col, col + p)
            last_prefix_col = col + p - 1 if p else -1
            col += p
            for branch, (member, end) in enumerate(zip(block.members, block.ends), start=1):
                own = end - p
                span = slice(col, col + own)
                out.tokens[r, span] = tokens[member, p:end]
                out.rope_positions[r, span] = np.arange(p, end)
                out.blocks[r, span] = block_id
                out.branches[r, span] = branch
                out.source_cols[r, span] = np.arange(col - 1, col + own - 1)
                out.source_cols[r, col] = last_prefix_col
                out.cells[member, p:end] = r * length + np.arange(col, col + own)
                col += own
    return out


def scatter(layout: Layout, values: np.ndarray) -> np.ndarray:
    """Per-token ``values`` [N, T, ...] placed in the packed rows [R, L, ...] (0 where no token; a shared prefix
    cell takes one member's value, so use it for values that are equal across a group or never scored)."""
    values = np.asarray(values)
    out = np.zeros((layout.shape[0] * layout.shape[1], *values.shape[2:]), values.dtype)
    placed = layout.cells >= 0
    out[layout.cells[placed]] = values[placed]
    return out.reshape(*layout.shape, *values.shape[2:])


def scorable(loss_mask: np.ndarray) -> np.ndarray:
    """``loss_mask`` without its first column: nothing predicts a row's first token (the padded layout never scores
    it either)."""
    mask = np.array(loss_mask, copy=True)
    mask[:, 0] = 0
    return mask


def scored_positions(layout: Layout, packed_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each packed row's agent-token columns [R, K] (:func:`agent_positions`, -1 padded) and the column of the
    state that predicts each (-1 where none)."""
    positions = agent_positions(packed_mask)
    sources = np.where(positions >= 0, np.take_along_axis(layout.source_cols, np.maximum(positions, 0), axis=1), -1)
    return positions, sources


def rows_per_call_for(rows: int, length: int, positions: int, multiple: int) -> int:
    """Packed rows of ``length`` per program call: about ``positions`` positions, a power of two (bounding the
    compiled shapes) no larger than ``rows`` needs, rounded up to a multiple of ``multiple`` (the mesh's rows)."""
    budget = max(1, positions // length)
    per_call = min(1 << (budget.bit_length() - 1), 1 << (rows - 1).bit_length())
    return -(-per_call // multiple) * multiple


def row_lengths(width: int) -> tuple[int, ...]:
    """The learner's packed row lengths for a batch ``width`` tokens wide: as long as its padded rows (one compiled
    shape per batch width, not one per packed length), or up to twice that where a group's block would not fit
    (splitting a block copies its prompt again)."""
    return (width, *(b for b in LENGTH_BUCKETS if width < b <= 2 * width))


def pack_training_batch(batch: TrainingBatch, group_ids: np.ndarray,
                        length_buckets: Sequence[int] = LENGTH_BUCKETS, max_block: int | None = None
                        ) -> TrainingBatch:
    """The same training inputs as packed rows (host arrays), with the sources, RoPE positions and segments the
    train step needs to score them."""
    mask = scorable(batch.loss_mask)
    batch = dataclasses.replace(batch, loss_mask=mask)
    layout = plan(batch.tokens, mask, group_ids, length_buckets, max_block)
    fields = {name: scatter(layout, getattr(batch, name)) for name in PER_TOKEN_FIELDS
              if getattr(batch, name) is not None}
    positions, sources = scored_positions(layout, fields["loss_mask"])
    real = (layout.blocks >= 0).any(axis=1).astype(np.float32)
    return TrainingBatch(tokens=layout.tokens, positions=positions, scores=np.zeros_like(real), valid=real,
                         sources=sources.astype(np.int32), rope_positions=layout.rope_positions,
                         blocks=layout.blocks, branches=layout.branches, **fields)


def pad_rows(batch: TrainingBatch, rows: int) -> TrainingBatch:
    """Appends empty rows (no tokens to score, their own padding segment) up to ``rows``."""
    extra = rows - batch.tokens.shape[0]
    if extra <= 0:
        return batch

    def pad(name: str, x: np.ndarray) -> np.ndarray:
        fill = -1 if name in ("positions", "sources", "blocks") else 0
        return np.concatenate([x, np.full((extra, *x.shape[1:]), fill, x.dtype)])

    return TrainingBatch(**{f.name: None if getattr(batch, f.name) is None else pad(f.name, getattr(batch, f.name))
                            for f in dataclasses.fields(batch)})


def packed_per_token(tokens: np.ndarray, loss_mask: np.ndarray, group_ids: np.ndarray, length_buckets: Sequence[int],
                     positions_per_call: int, row_multiple: int, compute: Callable[..., dict[str, np.ndarray]]
                     ) -> dict[str, np.ndarray]:
    """Per-token values [N, T, ...] computed over the trajectories packed (:func:`plan`: a group's shared prompt
    once, each row cut after its last agent token). ``compute(tokens, rope_positions, blocks, branches, positions,
    sources)`` gets [rows, L] arrays (the agent positions and their sources [rows, K]; about ``positions_per_call``
    positions, a power of two of rows and a multiple of ``row_multiple``, padding rows empty) and returns named
    [rows, L, ...] arrays, read back per trajectory token: 0 past a row's last agent token and in rows without
    agent tokens, which no token-level loss reads."""
    mask = scorable(loss_mask)
    layout = plan(tokens, mask, group_ids, length_buckets, max_block=length_buckets[-1])
    rows, length = layout.shape
    positions, sources = scored_positions(layout, scatter(layout, mask))
    rows_per_call = rows_per_call_for(rows, length, positions_per_call, row_multiple)
    calls = -(-rows // rows_per_call)
    padded = lambda x, fill: np.concatenate(  # noqa: E731
        [x, np.full((calls * rows_per_call - rows, x.shape[1]), fill, x.dtype)])
    inputs = (padded(layout.tokens, 0), padded(layout.rope_positions, 0), padded(layout.blocks, -1),
              padded(layout.branches, 0), padded(positions.astype(np.int32), -1), padded(sources.astype(np.int32), -1))
    parts = [compute(*(x[c * rows_per_call:(c + 1) * rows_per_call] for x in inputs)) for c in range(calls)]
    placed = layout.cells >= 0
    out = {}
    for name in parts[0]:
        flat = np.concatenate([np.asarray(part[name]) for part in parts])[:rows]
        flat = flat.reshape(rows * length, *flat.shape[2:])
        out[name] = np.zeros((*layout.cells.shape, *flat.shape[1:]), flat.dtype)
        out[name][placed] = flat[layout.cells[placed]]
    return out
