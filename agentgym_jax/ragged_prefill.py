"""Ragged prefill: rows of very different lengths computed in length-sorted parts, not one padded block.

A prefill (or the prompt part of a generate call) computes ``batch bucket x token bucket`` positions. When one row
brings 370 new tokens and eleven others 150, one padded block is 16 x 512 = 8192 positions for about 2000 real
ones. Sorted by length and cut into parts, each padded to its own buckets, the same rows cost far fewer. Each part
is a further program call (its rows are copied out of the batch's cache and back), priced as ``call_cost``
positions; the plan below is the cheapest cut under that price. (Within a part, a long prompt is written in
fixed-size chunks: ``SamplerConfig.prefill_chunk``.)
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Sequence

import jax

from agentgym_jax import sharding
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


@partial(jax.jit, donate_argnames=("cache",))
def put_rows_program(cache: KVCache, part: KVCache, index: jax.Array) -> KVCache:
    """Writes ``part``'s rows into ``cache`` at rows ``index`` (an out-of-range index skips that part row)."""
    put = lambda whole, rows: sharding.constrain(whole.at[index].set(rows, mode="drop"), "kv_cache")  # noqa: E731
    return dataclasses.replace(cache, keys=[put(k, p) for k, p in zip(cache.keys, part.keys)],
                               values=[put(v, p) for v, p in zip(cache.values, part.values)],
                               lengths=cache.lengths.at[index].set(part.lengths, mode="drop"))
