"""Prefill: the program that writes prompt tokens into the KV cache over a live window, and ragged prefill.

Ragged prefill: rows of very different lengths computed in length-sorted parts, not one padded block.

A prefill (or the prompt part of a generate call) computes ``batch bucket x token bucket`` positions. When one row
brings 370 new tokens and eleven others 150, one padded block is 16 x 512 = 8192 positions for about 2000 real
ones. Sorted by length and cut into parts, each padded to its own buckets, the same rows cost far fewer. Each part
is a further program call (the slots its rows reach are copied out of the batch's cache and back), priced as
``call_cost`` positions; the plan below is the cheapest cut under that price. (Within a part, a long prompt is
written in fixed-size chunks, ``SamplerConfig.prefill_chunk``, and the rest in token buckets: :func:`plan_pieces`.)
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from agentgym_jax import native_kernels, prepacked, sharding
from agentgym_jax.attention import KEY_SLOT_AXIS, VALUE_SLOT_AXIS
from agentgym_jax.model import KVCache

Sizer = Callable[[int], int]


def plan_parts(lengths: Sequence[int], positions: Sizer, batch_bucket: Sizer, call_cost: int
               ) -> tuple[list[list[int]], int]:
    """The rows with new tokens (``lengths[r] > 0``), longest first, cut into consecutive parts that minimize
    the positions computed (each part ``batch_bucket(rows) x positions(its longest)``) plus ``call_cost`` per
    part; returns the parts and that total. Dynamic programming over the cut points: O(rows^2)."""
    rows = sorted((r for r, n in enumerate(lengths) if n > 0), key=lambda r: (-lengths[r], r))
    best = [0] + [None] * len(rows)
    cut = [0] * (len(rows) + 1)
    for end in range(1, len(rows) + 1):
        for start in range(end):
            cost = best[start] + batch_bucket(end - start) * positions(lengths[rows[start]]) + call_cost
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    parts, end = [], len(rows)
    while end:
        parts.append(rows[cut[end]:end])
        end = cut[end]
    return parts[::-1], best[-1]


# A prefill's last partial chunk is split into smaller token buckets only where that saves this many positions
# per row: a further call reads every weight once more, which costs about as much as computing a few dozen positions.
PIECE_SAVING = 32


def plan_pieces(length: int, chunk: int, positions: Sizer, buckets: Sequence[int]) -> list[int]:
    """Tokens per program call when prefilling ``length`` tokens: ``chunk``-sized chunks (0: one call), then the
    rest in ``buckets`` (``positions`` pads a size to its bucket), split where that saves at least
    ``PIECE_SAVING`` positions a row (a 71-token rest: 64 + 7 tokens in 64 + 16 positions, not 128)."""
    if not chunk:
        return [length] if length else []
    full, rest = divmod(length, chunk)
    pieces = [chunk] * full
    while rest:
        smaller = max((b for b in buckets if b < rest), default=0)
        split = smaller + positions(rest - smaller) if smaller else rest
        piece = smaller if positions(rest) - split >= PIECE_SAVING else rest
        pieces.append(piece)
        rest -= piece
    return pieces


@partial(jax.jit, static_argnames=("window",))
def take_rows_program(cache: KVCache, index: jax.Array, *, window: int) -> KVCache:
    """The first ``window`` slots of ``cache``'s rows ``index``, as a cache of their own (an out-of-range index
    gives an empty row)."""
    take = lambda x, axis: sharding.constrain(  # noqa: E731
        jnp.take(jax.lax.slice_in_dim(x, 0, window, axis=axis), index, axis=0, mode="fill", fill_value=0),
        "kv_cache")
    return dataclasses.replace(cache, keys=[take(k, KEY_SLOT_AXIS) for k in cache.keys],
                               values=[take(v, VALUE_SLOT_AXIS) for v in cache.values],
                               lengths=jnp.take(cache.lengths, index, mode="fill", fill_value=0))


@partial(jax.jit, donate_argnames=("cache",))
def put_rows_program(cache: KVCache, part: KVCache, index: jax.Array) -> KVCache:
    """Writes ``part``'s rows over the first ``part.capacity`` slots of ``cache``'s rows ``index``, in place (an
    out-of-range index skips that part row)."""
    def put(whole: jax.Array, rows: jax.Array, axis: int) -> jax.Array:
        slots = (slice(None),) * (axis - 1) + (slice(0, rows.shape[axis]),)
        return sharding.constrain(whole.at[(index,) + slots].set(rows, mode="drop"), "kv_cache")

    return dataclasses.replace(cache, keys=[put(k, p, KEY_SLOT_AXIS) for k, p in zip(cache.keys, part.keys)],
                               values=[put(v, p, VALUE_SLOT_AXIS) for v, p in zip(cache.values, part.values)],
                               lengths=cache.lengths.at[index].set(part.lengths, mode="drop"))


@partial(jax.jit, static_argnames=("graphdef", "window"), donate_argnames=("cache",))
def prefill_program(state: Any, cache: KVCache, new_tokens: jax.Array, new_lengths: jax.Array,
                    packed: dict[str, jax.Array], *, graphdef: Any, window: int):
    """Writes each row's new tokens into its cache without sampling (rows with length 0 are untouched),
    attending over the first ``window`` slots. ``packed``: the sampler's packed weights (agentgym_jax.prepacked),
    whose AMX panels the products of many rows read instead of reordering w in each call (may be empty)."""
    model = nnx.merge(graphdef, state)
    # never differentiated: the sampling-only kernels may run
    with native_kernels.inference_only(), prepacked.replaying(state, packed):
        _, cache = model.forward(new_tokens, cache=limit_window(cache, window))
    return dataclasses.replace(cache, lengths=cache.lengths + new_lengths, window=None)


def window_view(cache: KVCache, window: int) -> KVCache:
    """The cache's first ``window`` slots, copied out (the host chose ``window`` so that no row passes it in this
    call): a generate call's decode loop carries and reads only these."""
    if window >= cache.capacity:
        return cache
    head = lambda x, axis: jax.lax.slice_in_dim(x, 0, window, axis=axis)  # noqa: E731
    return dataclasses.replace(cache, keys=[head(k, KEY_SLOT_AXIS) for k in cache.keys],
                               values=[head(v, VALUE_SLOT_AXIS) for v in cache.values])


def write_back(full: KVCache, view: KVCache) -> KVCache:
    """``full`` with the updated window ``view`` written over its first slots (and ``view``'s lengths)."""
    if view.capacity == full.capacity:
        return view
    put = lambda whole, part, axis: jax.lax.dynamic_update_slice_in_dim(whole, part, 0, axis=axis)  # noqa: E731
    return dataclasses.replace(
        view, keys=[put(k, part, KEY_SLOT_AXIS) for k, part in zip(full.keys, view.keys)],
        values=[put(v, part, VALUE_SLOT_AXIS) for v, part in zip(full.values, view.values)],
    )


def limit_window(cache: KVCache, window: int) -> KVCache:
    """The cache with attention limited to its first ``window`` slots, not copied: the layers write into the whole
    cache and read a slice of it (a prefill's copied-out windows cost about as much as its attention)."""
    return dataclasses.replace(cache, window=window)
