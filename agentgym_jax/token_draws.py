"""Per-row token draws: greedy picks, top-k / top-p filtering by a threshold search, and an inverse-CDF draw.

Neither sorts the vocabulary. Sorting 8 rows of a 49k vocabulary cost 97 ms per decode step on a CPU; the
threshold search costs 2 x 32 masked reductions over the same logits. Without filtering, CPUs with AVX-512 pick with
one native kernel (:func:`native_kernels.token_pick`) instead of XLA's chain of single-threaded passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentgym_jax import native_kernels

_SEARCH_STEPS = 32  # bisection over the 2^32 int32 keys: exact


def row_uniforms(row_keys: jax.Array) -> jax.Array:
    """One uniform number in [0, 1) per row key [B]: what a row's draw inverts its distribution at (the pure-JAX
    draw and the native kernel take the same numbers, so they draw the same tokens)."""
    return jax.vmap(jax.random.uniform)(row_keys)


def inverse_cdf_sample(row_keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row from ``softmax(logits)`` [B, V] by inverting its cumulative distribution with one uniform
    number per row. Exact like Gumbel-max (``jax.random.categorical``), which needs V random numbers per row:
    hashing those was 4x the cost of this whole function on a CPU (22 vs 5 ms at 32 x 49k)."""
    uniform = row_uniforms(row_keys)
    cdf = jnp.cumsum(jax.nn.softmax(logits, axis=-1), axis=-1)
    # The first index whose cumulative mass exceeds u * total: a zero-probability token is never picked.
    picked = jnp.sum(cdf <= (uniform * cdf[:, -1])[:, None], axis=-1)
    return jnp.minimum(picked, logits.shape[-1] - 1)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> int32 keys with the same order (so a bisection over keys is exact, not within a tolerance)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _lowest_passing_key(keys: jax.Array, passes) -> jax.Array:
    """Per row, the smallest int32 ``t`` with ``passes(t)`` [B] true, for a ``passes`` that is monotone in ``t``
    and true at the row's largest key."""
    high = keys.max(axis=-1)
    low = keys.min(axis=-1) - 1  # the smallest key itself may pass: start below it

    def step(_, bounds):
        low, high = bounds
        middle = (low >> 1) + (high >> 1) + (low & high & 1)  # floor((low + high) / 2) without overflow
        ok = passes(middle)
        return jnp.where(ok, low, middle), jnp.where(ok, middle, high)

    return jax.lax.fori_loop(0, _SEARCH_STEPS, step, (low, high))[1]


def top_k_top_p_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Which tokens of ``logits`` [B, V] a row may draw: its ``top_k`` [B] most likely (0: all), then of those
    the smallest most-likely set whose probability (renormalized within the top k) reaches ``top_p`` [B].

    A token is kept when fewer than k tokens, and less than p of the mass, rank strictly above it. Tokens tied
    at the boundary are kept together (a sort would keep an arbitrary one of them).
    """
    keys = _order_keys(logits)
    above = lambda t: keys > t[:, None]  # noqa: E731
    k = jnp.where(top_k > 0, top_k, logits.shape[-1])
    k_threshold = _lowest_passing_key(keys, lambda t: jnp.sum(above(t), axis=-1) < k)
    in_top_k = keys >= k_threshold[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, logits, -jnp.inf), axis=-1)
    # top_p >= 1 keeps everything: a rounded mass of 1.0000001 above the least likely tokens must not drop them
    p_threshold = _lowest_passing_key(
        keys, lambda t: (jnp.sum(jnp.where(above(t), probs, 0.0), axis=-1) < top_p) | (top_p >= 1.0))
    return in_top_k & (keys >= p_threshold[:, None])


def first_argmax(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, -1)`` for finite logits [B, V] (the first index of each row's maximum), as two plain
    reductions: XLA's CPU backend runs argmax's paired (value, index) reduction 7x slower than a max and a min."""
    vocab = logits.shape[-1]
    top = logits.max(axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(first, vocab - 1)  # a row of NaNs has no maximum: its last index, not out of range


def draw_tokens(
    logits: jax.Array, keys: jax.Array, counters: jax.Array, temperature: jax.Array, top_p: jax.Array,
    top_k: jax.Array, filtered: bool, logprob_temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """One token per row of ``logits`` [B, V]: greedy where ``temperature`` is 0, else drawn at that temperature
    (top-k / top-p when ``filtered``) with the row's key folded with its ``counters``; returns (ids [B], the
    model's log-probs of them at ``logprob_temperature``). A batch with no greedy row skips the greedy pick and
    one with only greedy rows skips the draw."""
    batch = logits.shape[0]
    row_keys = jax.vmap(jax.random.fold_in)(keys, counters)
    if not filtered and native_kernels.token_pick_applies(logits):
        return native_kernels.token_pick(logits, temperature, row_uniforms(row_keys), logprob_temperature)
    logprobs_all = jax.nn.log_softmax(logits / logprob_temperature, axis=-1)
    greedy_rows = temperature == 0
    none = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731

    def draw() -> jax.Array:
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        if filtered:
            scaled = jnp.where(top_k_top_p_mask(scaled, top_k, top_p), scaled, -jnp.inf)
        return inverse_cdf_sample(row_keys, scaled).astype(jnp.int32)

    greedy = jax.lax.cond(jnp.any(greedy_rows), lambda: first_argmax(logits), none)
    sampled = jax.lax.cond(jnp.all(greedy_rows), none, draw)
    tokens = jnp.where(greedy_rows, greedy, sampled)
    return tokens, jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
