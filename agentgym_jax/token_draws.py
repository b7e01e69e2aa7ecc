"""Per-row token draws: top-k / top-p filtering by a threshold search, and an inverse-CDF draw.

Neither sorts the vocabulary. Sorting 8 rows of a 49k vocabulary cost 97 ms per decode step on a CPU; the
threshold search costs 2 x 32 masked reductions over the same logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_SEARCH_STEPS = 32  # bisection over the 2^32 int32 keys: exact


def inverse_cdf_sample(row_keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row from ``softmax(logits)`` [B, V] by inverting its cumulative distribution with one uniform
    number per row. Exact like Gumbel-max (``jax.random.categorical``), which needs V random numbers per row:
    hashing those was 4x the cost of this whole function on a CPU (22 vs 5 ms at 32 x 49k)."""
    uniform = jax.vmap(jax.random.uniform)(row_keys)  # [B] in [0, 1)
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
