"""Decode-step attention benchmark: the native kernel against the pure-JAX path, same caches, same run.

One decode step's attention for SmolLM2-135M's 30 layers (3 kv heads of 3 queries, head dim 64): each layer
writes the step's key and value into its cache and attends over the row's own slots (one call per layer). Ours is
``native_kernels.decode_attention`` (``native/decode_attention.cc``); the peer is the model's pure-JAX path
(``attention.write_slots`` then ``attend_one_query`` over the live window, as XLA compiles it with the native
kernels off). Rows hold 80-100% of ``context`` tokens in a cache of ``2 x context`` slots (the live window is the
smallest multiple of 128 that covers them); bf16 and fp32 caches, batch 8 and 32, contexts from a short prompt to a
long multi-turn history, where the attention outweighs the weights. Reported: ms per step (30 layers), the cache
GB/s read (live slots only), the step against the copy bandwidth, and ours / pure JAX. Ours and the peer are timed
interleaved, medians of the repeats. Writes ``benchmarks/results/decode_attention.json``.

Usage: python -m benchmarks.decode_attention [--repeats=9] [--batches=8,32] [--contexts=256,1024,2048]
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from agentgym_jax import attention, native_kernels
from agentgym_jax.model import Attention
from benchmarks import common

_REPEATS = flags.DEFINE_integer("repeats", 9, "Timed steps per case (after a compiling one).")
_BATCHES = flags.DEFINE_list("batches", ["8", "32"], "Batch sizes.")
_CONTEXTS = flags.DEFINE_list("contexts", ["256", "1024", "2048"], "Longest row's tokens in the cache.")
_DTYPES = flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Cache dtypes.")

LAYERS, KV_HEADS, GROUPS, HEAD_DIM = 30, 3, 3, 64
SCALE = 1.0 / HEAD_DIM**0.5


def _caches(batch: int, slots: int, dtype: str) -> tuple[list[jax.Array], list[jax.Array]]:
    """30 layers' raw keys [B, K, H, T] and values [B, K, T, H] of random entries."""
    def entries(seed: int, shape: tuple[int, ...]) -> jax.Array:
        return attention.to_storage(jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype))
    keys = [entries(2 * i, (batch, KV_HEADS, HEAD_DIM, slots)) for i in range(LAYERS)]
    values = [entries(2 * i + 1, (batch, KV_HEADS, slots, HEAD_DIM)) for i in range(LAYERS)]
    return keys, values


def _layer_step(native: bool, dtype: str, window: int) -> Any:
    """One layer's jitted cache write and attention (its cache donated and updated in place), ours or the pure-JAX
    path. A step calls it once per layer: a single program of all 30 layers ran XLA's path ~8x slower than 30 calls
    of this one (138 against 16.8 ms at batch 8 and 256 tokens; why was not pinned down), which would misstate
    that peer."""
    def run(q: jax.Array, new: jax.Array, keys: jax.Array, values: jax.Array, lengths: jax.Array) -> tuple:
        if native:
            return native_kernels.decode_attention(q, keys, values, new, new, lengths, SCALE, dtype)
        cache = attention.LayerCache(keys, values, jnp.dtype(dtype), window)
        out, cache = Attention._attend(q, new, new, SCALE, cache, lengths, None)
        return out, cache.keys, cache.values

    return jax.jit(run, donate_argnums=(2, 3))


def _run_step(layer_step: Any, q: jax.Array, new: jax.Array, side: dict[str, Any], lengths: jax.Array) -> None:
    """All layers' decode step for one side (its caches replaced by the updated ones), waited for."""
    outs = []
    for i in range(LAYERS):
        out, side["keys"][i], side["values"][i] = layer_step(q, new, side["keys"][i], side["values"][i], lengths)
        outs.append(out)
    jax.block_until_ready(outs)


def _case(batch: int, context: int, dtype: str, repeats: int, bandwidth: float) -> dict[str, Any]:
    slots = 2 * context
    rng = np.random.RandomState(batch + context)
    lengths = jnp.asarray(rng.randint(int(0.8 * context), context, batch), jnp.int32)  # filled before this step
    window = -(-(int(lengths.max()) + 1) // 128) * 128
    q = jax.random.normal(jax.random.PRNGKey(7), (batch, 1, KV_HEADS, GROUPS, HEAD_DIM), jnp.float32).astype(dtype)
    new = jax.random.normal(jax.random.PRNGKey(8), (batch, 1, KV_HEADS, HEAD_DIM), jnp.float32).astype(dtype)
    sides: dict[str, dict[str, Any]] = {}
    for name, native in (("ours", True), ("pure_jax", False)):
        keys, values = _caches(batch, slots, dtype)
        side = dict(step=_layer_step(native, dtype, window), keys=keys, values=values, seconds=[])
        with contextlib.nullcontext() if native else common.without_native_kernels():
            _run_step(side["step"], q, new, side, lengths)  # compiles: traced with the kernels on or off
        sides[name] = side
    for _ in range(repeats):  # interleaved: both see the same machine load
        for side in sides.values():
            start = time.perf_counter()
            _run_step(side["step"], q, new, side, lengths)
            side["seconds"].append(time.perf_counter() - start)
    live = float(np.sum(np.asarray(lengths) + 1))
    cache_bytes = LAYERS * live * KV_HEADS * HEAD_DIM * 2 * jnp.dtype(dtype).itemsize  # keys and values read
    row: dict[str, Any] = dict(batch=batch, context=context, cache_slots=slots, window=window, dtype=dtype,
                               live_cache_mb=cache_bytes / 1e6,
                               bandwidth_bound_ms=1000 * cache_bytes / (bandwidth * 1e9))
    for name, side in sides.items():
        ms = 1000 * common.median(side["seconds"])
        row[f"{name}_ms"] = ms
        row[f"{name}_cache_gbs"] = cache_bytes / ms / 1e6
        row[f"{name}_vs_bound"] = ms / row["bandwidth_bound_ms"]
    row["speedup_vs_pure_jax"] = row["pure_jax_ms"] / row["ours_ms"]
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return row


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    wall = time.perf_counter()
    bandwidth = common.memory_bandwidth_gbs()
    table = [_case(int(b), int(c), d, _REPEATS.value, bandwidth)
             for d in _DTYPES.value for b in _BATCHES.value for c in _CONTEXTS.value]
    payload = dict(
        definition=("one decode step's cache write and attention over 30 layers (SmolLM2-135M's 3 kv heads x 3 "
                    "queries, head dim 64); rows hold 80-100% of `context` tokens in 2 x context slots; "
                    "cache GB/s counts the live slots' keys and values once"),
        speedup_vs_pure_jax={f"b{r['batch']}_{r['context']}_{r['dtype']}": r["speedup_vs_pure_jax"] for r in table},
        ours_vs_bound={f"b{r['batch']}_{r['context']}_{r['dtype']}": r["ours_vs_bound"] for r in table},
        table=table, memory_bandwidth_gbs_copy=bandwidth, cpu=common.cpu_facts(),
        native_kernels_enabled=native_kernels.enabled(), peak_rss_mib=common.peak_rss_mib(),
        load_average_at_end=list(os.getloadavg()), benchmark_seconds=time.perf_counter() - wall,
        versions=dict(jax=jax.__version__),
    )
    print(common.write_json("decode_attention", payload))


if __name__ == "__main__":
    app.run(main)
