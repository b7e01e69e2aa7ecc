"""Attention math of the decoder: RoPE, packed-row segments, and softmax attention over the cache's layouts
(keys [B, K, H, T], values [B, K, T, H]).

Two kernels compute the same thing: :func:`attend` (batched dots, any number of queries) and
:func:`attend_one_query` (fused multiply-reduces, one query per row: the decode step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates ``x`` [B, S, heads, H] by ``positions`` [B, S] (HF's rotate-half layout)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, S, H/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


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
    """The floats of ``dtype`` a cache holds in ``raw``."""
    return raw if raw.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(raw, dtype)


def write_slots(raw: jax.Array, slots: jax.Array, new: jax.Array, dtype: Any, axis: int) -> jax.Array:
    """The stored cache ``raw`` [B, K, ., .] of ``dtype``, slots on ``axis`` (2 or 3), with row b's ``new``
    [B, S, K, H] entries written at ``slots`` [B, S]; slots past the end are dropped, never clamped."""
    rows = jnp.arange(raw.shape[0])[:, None]
    # Index arrays around slices put their dimensions first: the update is [B, S, K, H] for either axis.
    index = (rows, slice(None), slots) if axis == 2 else (rows, slice(None), slice(None), slots)
    return raw.at[index].set(to_storage(new.astype(dtype)), mode="drop")


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """Softmax attention of q [B, S, K, G, H] over keys k [B, K, H, T] and values v [B, K, T, H] where
    ``allowed`` [B, S, T]; [B, S, K, G, H]."""
    scores = jnp.einsum("bskgh,bkht->bkgst", q, k).astype(jnp.float32) * scale
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgst,bkth->bskgh", probs, v)


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
