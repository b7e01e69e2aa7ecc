"""Attention math of the decoder: RoPE, packed-row segments, and softmax attention over the cache's layouts
(keys [B, K, H, T], values [B, K, T, H]).

Four kernels compute the same thing: :func:`attend` (one product per kv head over its [G*S, H] queries, in
query blocks past 128: prefill into a cache),
:func:`attend_one_query` (fused multiply-reduces, one query per row: the decode step), :func:`attend_in_blocks`
(a scan over query blocks with FlashAttention's backward pass) and :func:`attend_causal` (teacher-forced rows:
causal parts, each in blocks).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates ``x`` [B, S, heads, H] by ``positions`` [B, S] (HF's rotate-half layout)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, S, H/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :].astype(x.dtype)
    return _rotate(x, cos, sin)


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], -1)


@jax.custom_vjp
def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin``, with its backward pass written out. Autodiff's transpose of the
    concatenate and slices became padded adds that XLA's CPU backend ran about seven times slower in bf16 (0.7 s
    of an 8.6 s train step); the gradients are the same values."""
    return x * cos + _rotate_half(x) * sin


def _rotate_forward(x, cos, sin):
    return _rotate(x, cos, sin), (x, cos, sin)


def _rotate_backward(residuals, g):
    x, cos, sin = residuals
    dx = g * cos - _rotate_half(g * sin)  # rotate_half's transpose is minus itself
    # cos and sin come from positions, never trained: their cotangents are exact and dropped as dead code
    over_heads = lambda v: jnp.sum(v, axis=2, keepdims=True).astype(cos.dtype)  # noqa: E731
    return dx, over_heads(g * x), over_heads(g * _rotate_half(x))


_rotate.defvjp(_rotate_forward, _rotate_backward)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """Who may attend to whom in a packed row ([B, S] each): a token sees an earlier token of its own block only
    when that token is on branch 0 (the block's shared prefix) or on the token's own branch."""

    blocks: jax.Array  # block id within the row; padding has its own id
    branches: jax.Array  # 0: the block's shared prefix; k > 0: one trajectory's own tokens

    def allowed(self) -> jax.Array:
        """[B, S, S] bool: query s may read key t (causality is applied separately)."""
        same_block = self.blocks[:, :, None] == self.blocks[:, None, :]
        branch_q, branch_k = self.branches[:, :, None], self.branches[:, None, :]
        return same_block & ((branch_k == 0) | (branch_k == branch_q))


# The T (slot) axis of a cache's keys [B, K, H, T] and of its values [B, K, T, H].
KEY_SLOT_AXIS, VALUE_SLOT_AXIS = 3, 2


class LayerCache(NamedTuple):
    """One layer's cache entries (keys [B, K, H, T], values [B, K, T, H]) of ``dtype``, held as
    :func:`storage_dtype` says."""

    keys: jax.Array
    values: jax.Array
    dtype: Any
    window: int | None = None  # slots attention reads (None: all)

    def readable(self, raw: jax.Array, axis: int) -> jax.Array:
        """The slots of ``raw`` (this layer's keys or values, slots on ``axis``) that attention reads: a slice XLA
        fuses into the reads, where a copied-out window cost as much as a prefill's attention."""
        if self.window is None or self.window >= raw.shape[axis]:
            return raw
        return jax.lax.slice_in_dim(raw, 0, self.window, axis=axis)


def storage_dtype(dtype: Any) -> Any:
    """The type a cache of float ``dtype`` is held in. 16-bit floats are held as their raw bits (uint16): XLA's
    CPU backend has no bf16 or f16 scatter, and converted the whole cache to fp32 and back on every write. Wider
    floats are held as themselves: their scatter is native, and a bits-to-float conversion would be copied out
    for the CPU's reduction kernels instead of fused."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if dtype.itemsize == 2 else dtype


def to_storage(x: jax.Array) -> jax.Array:
    """``x`` as the cache holds it (:func:`storage_dtype`)."""
    stored = storage_dtype(x.dtype)
    return x if stored == x.dtype else jax.lax.bitcast_convert_type(x, stored)


def from_storage(raw: jax.Array, dtype: Any) -> jax.Array:
    """The floats of ``dtype`` a cache holds in ``raw``. bf16 bits are the top half of the same fp32 number, so
    they are widened by a shift: integer steps XLA fuses into the attention's reads, where a 16-bit bitcast was
    copied out as a bf16 window per layer and step (a decode step at batch 32: 117-120 -> 100-102 ms)."""
    dtype = jnp.dtype(dtype)
    if raw.dtype == dtype:
        return raw
    if dtype == jnp.bfloat16 and raw.dtype == jnp.uint16:
        widened = jax.lax.bitcast_convert_type(raw.astype(jnp.uint32) << 16, jnp.float32)
        return widened.astype(dtype)  # exact: the fp32 number has no bits below bf16's
    return jax.lax.bitcast_convert_type(raw, dtype)


def write_slots(raw: jax.Array, slots: jax.Array, new: jax.Array, dtype: Any, axis: int) -> jax.Array:
    """The stored cache ``raw`` [B, K, ., .] of ``dtype``, slots on ``axis`` (2 or 3), with row b's ``new``
    [B, S, K, H] entries written at ``slots`` [B, S]; slots past the end are dropped, never clamped."""
    rows = jnp.arange(raw.shape[0])[:, None]
    # Index arrays around slices put their dimensions first: the update is [B, S, K, H] for either axis.
    index = (rows, slice(None), slots) if axis == 2 else (rows, slice(None), slice(None), slots)
    return raw.at[index].set(to_storage(new.astype(dtype)), mode="drop")


# Queries per block of :func:`attend_in_blocks`: its score tile [B, K, G, block, T] then stays small enough for the
# CPU's caches, and the backward pass recomputes one tile at a time instead of keeping every layer's probabilities.
QUERY_BLOCK = 128


def _grouped(q: jax.Array) -> jax.Array:
    """q [B, S, K, G, H] as [B, K, G*S, H]: one matrix of queries per kv head for the batched products below."""
    b, s, k, g, h = q.shape
    return jnp.moveaxis(q, 1, 3).reshape(b, k, g * s, h)


def _per_head_dot(x: jax.Array, y: jax.Array, x_axis: int, y_axis: int) -> jax.Array:
    """fp32 product of ``x`` and ``y`` [B, K, ., .] per (B, K), contracting ``x``'s axis ``x_axis`` with ``y``'s
    ``y_axis`` (2 or 3 each): [B, K, x's other axis, y's other axis]."""
    return jax.lax.dot_general(x, y, (((x_axis,), (y_axis,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)


def _ungrouped(x: jax.Array, groups: int) -> jax.Array:
    """The inverse of :func:`_grouped`: [B, K, G*S, H] as [B, S, K, G, H]."""
    b, k, gs, h = x.shape
    return jnp.moveaxis(x.reshape(b, k, groups, gs // groups, h), 3, 1)


def _scores(q: jax.Array, k: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """Masked fp32 scores [B, K, G, S, T] of q [B, S, K, G, H] over keys k [B, K, H, T].

    Written as one [G*S, H] x [H, T] product per kv head with an fp32 result: an einsum over the five-axis layouts
    had XLA's CPU backend transpose the score tensor after a generic batched dot, and round bf16 scores to bf16."""
    b, s, kv, g, _ = q.shape
    scores = _per_head_dot(_grouped(q), k, 3, 2).reshape(b, kv, g, s, -1) * scale
    return jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)


def _weighted_values(probs: jax.Array, v: jax.Array, dtype: Any) -> jax.Array:
    """``probs`` [B, K, G, S, T] times values v [B, K, T, H], accumulated in fp32: [B, S, K, G, H] of ``dtype``."""
    b, kv, g, s, t = probs.shape
    return _ungrouped(_per_head_dot(probs.astype(v.dtype).reshape(b, kv, g * s, t), v, 3, 2), g).astype(dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """Softmax attention of q [B, S, K, G, H] over keys k [B, K, H, T] and values v [B, K, T, H] where
    ``allowed`` [B, S, T]; [B, S, K, G, H]. More than ``QUERY_BLOCK`` queries (a prompt prefilled into a cache)
    go one block at a time, forward only: the same result, from tiles that stay in the CPU's caches (a 256-token
    prompt's attention ran ~2x faster, 512 tokens 2-3x)."""
    s = q.shape[1]
    if s > QUERY_BLOCK and s % QUERY_BLOCK == 0:
        return _blocked_forward(q, k, v, allowed, scale, QUERY_BLOCK)[0]
    return _dense(q, k, v, allowed, scale)


def _dense(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """:func:`attend` over every query at once."""
    return _weighted_values(jax.nn.softmax(_scores(q, k, allowed, scale), axis=-1), v, q.dtype)


def attend_one_query(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """:func:`attend` for one query per row (a decode step), as fused multiply-reduces in fp32.

    A decode step reads the whole cache for a few flops per element. XLA's CPU backend ran the batched dots of
    :func:`attend` (B x K tiny matrices) 3-10x slower than memory allows; these two products reduce over the
    cache's non-minor axis (H of the keys, T of the values), vectorized along the minor one, and read each entry
    once, in bf16 too without a converted copy."""
    f32 = jnp.float32
    scores = (q[:, 0, :, :, :, None].astype(f32) * k[:, :, None].astype(f32)).sum(-2) * scale  # [B, K, G, T]
    scores = jnp.where(allowed[:, None], scores, jnp.finfo(f32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = (probs[..., None] * v[:, :, None].astype(f32)).sum(-2)  # [B, K, G, H]
    return out[:, None].astype(q.dtype)


def _to_blocks(x: jax.Array, block: int) -> jax.Array:
    """[B, S, ...] -> [S / block, B, block, ...] (the scan's axis first)."""
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:]), 1, 0)


def _from_blocks(x: jax.Array) -> jax.Array:
    """The inverse of :func:`_to_blocks`."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blocked(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float, block: int) -> jax.Array:
    return _blocked_forward(q, k, v, allowed, scale, block)[0]


def _blocked_forward(q, k, v, allowed, scale, block):
    """The output [B, S, K, G, H] and each query's log-sum-exp [S / block, B, K, G, block], one query block a step."""

    def one_block(_, xs):
        q_block, allowed_block = xs
        scores = _scores(q_block, k, allowed_block, scale)
        top = scores.max(-1, keepdims=True)
        weights = jnp.exp(scores - top)
        total = weights.sum(-1, keepdims=True)
        out = _weighted_values(weights / total, v, q.dtype)
        return None, (out, (top + jnp.log(total))[..., 0])

    _, (out, lse) = jax.lax.scan(one_block, None, (_to_blocks(q, block), _to_blocks(allowed, block)))
    return _from_blocks(out), lse


def _blocked_fwd(q, k, v, allowed, scale, block):
    out, lse = _blocked_forward(q, k, v, allowed, scale, block)
    return out, (q, k, v, allowed, out, lse)


def _blocked_bwd(scale, block, residuals, d_out):
    """FlashAttention's backward pass, one query block a step: the probabilities are recomputed from the saved
    log-sum-exp; key and value gradients accumulate in fp32 across the blocks."""
    q, k, v, allowed, out, lse = residuals
    f32 = jnp.float32
    # D_s = sum_h dO * O: the softmax gradient's per-query term.
    delta = (d_out.astype(f32) * out.astype(f32)).sum(-1)  # [B, S, K, G]

    def one_block(carry, xs):
        d_k, d_v = carry
        q_block, allowed_block, d_out_block, lse_block, delta_block = xs
        probs = jnp.where(allowed_block[:, None, None],
                          jnp.exp(_scores(q_block, k, allowed_block, scale) - lse_block[..., None]), 0.0)
        # Per kv head, [G*S, .] matrices (:func:`_grouped`); d_v accumulates as [B, K, H, T], the keys' layout.
        b, kv, g, s, t = probs.shape
        d_out_rows, q_rows = _grouped(d_out_block), _grouped(q_block)
        d_v = d_v + _per_head_dot(d_out_rows, probs.astype(v.dtype).reshape(b, kv, g * s, t), 2, 2)
        d_probs = _per_head_dot(d_out_rows, v, 3, 3).reshape(probs.shape)
        d_scores = (probs * (d_probs - jnp.moveaxis(delta_block, 1, -1)[..., None]) * scale).astype(q.dtype)
        d_score_rows = d_scores.reshape(b, kv, g * s, t)
        d_q = _ungrouped(_per_head_dot(d_score_rows, k, 3, 3), g)
        d_k = d_k + _per_head_dot(q_rows, d_score_rows, 2, 2)
        return (d_k, d_v), d_q

    zeros = (jnp.zeros(k.shape, f32), jnp.zeros(k.shape, f32))
    q_blocks, allowed_blocks, d_out_blocks, delta_blocks = (
        _to_blocks(x, block) for x in (q, allowed, d_out.astype(q.dtype), delta))
    (d_k, d_v), d_q = jax.lax.scan(one_block, zeros, (q_blocks, allowed_blocks, d_out_blocks, lse, delta_blocks))
    return _from_blocks(d_q).astype(q.dtype), d_k.astype(k.dtype), jnp.swapaxes(d_v, 2, 3).astype(v.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def attend_in_blocks(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float,
                     block: int = QUERY_BLOCK) -> jax.Array:
    """:func:`attend` one block of ``block`` queries at a time (a scan), with FlashAttention's backward pass.

    Both compute the same softmax attention. On a CPU the whole [B, K, G, S, T] score tensor of a 512-token
    training row misses the caches at every elementwise pass, and its autodiff keeps every layer's probabilities
    for the backward pass; one block's tile is a quarter of it, and the backward pass recomputes the tiles. Rows
    whose query count is not a multiple of ``block`` (or holds a single block) take the dense kernel: every query
    at once, differentiated by autodiff (what :func:`attend` runs for up to ``QUERY_BLOCK`` queries)."""
    s = q.shape[1]
    if s <= block or s % block:
        return _dense(q, k, v, allowed, scale)
    return _blocked(q, k, v, allowed, scale, block)


# Teacher-forced rows are cut into this many parts of queries: part i reads only the keys up to its last query.
CAUSAL_PARTS = 2


def attend_causal(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float,
                  parts: int = CAUSAL_PARTS, block: int = QUERY_BLOCK) -> jax.Array:
    """:func:`attend` for a teacher-forced row: queries at the keys' own slots 0..S-1, ``allowed`` within the
    causal mask. Part i of the ``parts`` equal query parts reads the keys up to its last query only (the rest are
    masked for all of them), through :func:`attend_in_blocks`: a 512-token row computes 3/4 of the scores, in tiles.
    Each part is a program region of its own, so more parts cost compile time."""
    s = q.shape[1]
    if s != k.shape[KEY_SLOT_AXIS]:
        raise ValueError(f"attend_causal needs the row's own keys: {s} queries, {k.shape[KEY_SLOT_AXIS]} keys")
    if parts <= 1 or s % parts:
        return attend_in_blocks(q, k, v, allowed, scale, block)
    size = s // parts
    return jnp.concatenate([
        attend_in_blocks(q[:, i * size:(i + 1) * size], k[..., :(i + 1) * size], v[:, :, :(i + 1) * size],
                         allowed[:, i * size:(i + 1) * size, :(i + 1) * size], scale, block)
        for i in range(parts)], axis=1)
