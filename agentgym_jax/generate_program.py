"""The sampler's jitted program: append each row's new tokens to its KV cache, then decode until the rows stop.

Each loop step feeds one token a row and draws the next from the logits it gives; a row stops at a stop id, a
stop sequence, its token budget or a full cache. The host side (batching, buckets, per-row state) is
:class:`agentgym_jax.sampling.Sampler`.
"""

from __future__ import annotations

import dataclasses
import enum
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from agentgym_jax import native_kernels, prefill, prepacked
from agentgym_jax.model import KVCache
from agentgym_jax.token_draws import draw_tokens

PROGRAM_NAME = "generate_program"  # its name in compile_stats


class StopReason(enum.IntEnum):
    """Why a row stopped generating in a call."""

    RUNNING = 0
    STOP_TOKEN = 1  # sampled an end-of-turn / EOS id (kept as the row's last token)
    STOP_SEQUENCE = 2  # the generated tail matched a stop sequence
    MAX_TOKENS = 3  # reached the row's max_new_tokens
    CACHE_FULL = 4  # the row's KV cache has no slot left (its history would be truncated otherwise)
    INACTIVE = 5  # the row took no part in this call (finished episode, or no new tokens)


@partial(jax.jit, static_argnames=("graphdef", "max_new", "stop_ids", "stop_sequences", "filtered", "window",
                                   "logprob_temperature"),
         donate_argnames=("cache",))
def generate_program(
    state: Any,
    cache: KVCache,
    new_tokens: jax.Array,  # [B, S] right-padded
    new_lengths: jax.Array,  # [B]; 0 = inactive row
    keys: jax.Array,  # [B] PRNG keys
    temperature: jax.Array,  # [B]
    top_p: jax.Array,  # [B]
    top_k: jax.Array,  # [B]
    max_new_tokens: jax.Array,  # [B] tokens of the whole turn
    drawn: jax.Array,  # [B] tokens of this turn drawn by earlier calls (a row resumed mid-turn; else 0)
    recent: jax.Array,  # [B, tail] a resumed row's last drawn ids, for stop sequences (-1 where none)
    stop_after: jax.Array,  # [] return once this many rows stopped (0: once every row's ids are in the cache)
    packed: dict[str, jax.Array],  # pack_program's packed weights for the decode loop (empty: packed in the program)
    *,
    graphdef: Any,
    max_new: int,
    stop_ids: tuple[int, ...],
    stop_sequences: tuple[tuple[int, ...], ...],
    filtered: bool,
    window: int,
    logprob_temperature: float = 1.0,
):
    model = nnx.merge(graphdef, state)
    batch = new_tokens.shape[0]
    capacity = cache.capacity
    rows = jnp.arange(batch)
    full_cache, cache = cache, prefill.window_view(cache, window)

    # Each loop step feeds one token a row (first each row's last new token, then the token it drew) and draws
    # the next from the logits it gives, so the program holds one copy of the model for S == 1, the usual call
    # (prompts arrive prefilled but for their last token). Longer blocks write all but their last token first.
    last = jnp.maximum(new_lengths - 1, 0)
    if new_tokens.shape[1] > 1:
        _, cache = model.forward(new_tokens, cache=cache)
        cache = dataclasses.replace(cache, lengths=cache.lengths + last)

    tail = recent.shape[1]
    active = new_lengths > 0
    reason = jnp.where(active, StopReason.RUNNING, StopReason.INACTIVE).astype(jnp.int32)
    carry = dict(
        step=jnp.int32(0), cache=cache, feed=new_tokens[rows, last], feeding=active, reason=reason,
        tokens=jnp.zeros((batch, max_new), jnp.int32), logprobs=jnp.zeros((batch, max_new), jnp.float32),
        count=drawn, recent=recent,
    )
    stop_id_array = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def cond(c):
        stopped = jnp.sum(active & (c["reason"] != StopReason.RUNNING))  # (a row's last id may be still unfed)
        return (c["step"] <= max_new) & jnp.any(c["feeding"]) & ((stop_after == 0) | (stopped < stop_after))

    def body(c):
        # Feed (stop tokens too: they belong to the conversation the next turn extends).
        hidden, cache = model.forward(c["feed"][:, None], cache=c["cache"])
        cache = dataclasses.replace(cache, lengths=cache.lengths + c["feeding"])
        logits = model.logits(hidden)[:, 0]
        reason, count = c["reason"], c["count"]
        running = reason == StopReason.RUNNING
        full = running & (cache.lengths >= capacity)
        reason = jnp.where(full, StopReason.CACHE_FULL, reason)
        running = running & ~full
        token, logprob = draw_tokens(logits, keys, count, temperature, top_p, top_k, filtered,
                                     logprob_temperature)
        token = jnp.where(running, token, 0)
        write_at = jnp.where(running, count - drawn, max_new)  # out of range -> dropped
        tokens = c["tokens"].at[rows, write_at].set(token, mode="drop")
        logprobs = c["logprobs"].at[rows, write_at].set(logprob, mode="drop")
        count = count + running
        recent = jnp.where(running[:, None], jnp.concatenate([c["recent"][:, 1:], token[:, None]], 1), c["recent"])
        hit_stop_id = jnp.any(token[:, None] == stop_id_array[None, :], axis=-1)
        hit_sequence = jnp.zeros((batch,), bool)
        for sequence in stop_sequences:
            pattern = jnp.asarray(sequence, jnp.int32)
            hit_sequence = hit_sequence | jnp.all(recent[:, tail - len(sequence):] == pattern[None, :], axis=-1)
        new_reason = jnp.where(
            hit_stop_id, StopReason.STOP_TOKEN,
            jnp.where(hit_sequence, StopReason.STOP_SEQUENCE,
                      jnp.where(count >= max_new_tokens, StopReason.MAX_TOKENS, StopReason.RUNNING)),
        )
        reason = jnp.where(running, new_reason, reason)
        return dict(step=c["step"] + 1, cache=cache, feed=token, feeding=running, reason=reason, tokens=tokens,
                    logprobs=logprobs, count=count, recent=recent)

    # the loop's projections read weights packed once: given (pack_program), or packed here before the loop
    with native_kernels.packed_projections(), prepacked.replaying(state, packed):
        out = jax.lax.while_loop(cond, body, carry)
    return (prefill.write_back(full_cache, out["cache"]), out["tokens"], out["logprobs"], out["count"] - drawn,
            out["reason"], out["feed"], out["recent"], out["feeding"])


@partial(jax.jit, static_argnames=("graphdef", "cache_dtype"))
def pack_program(state: Any, *, graphdef: Any, cache_dtype: Any) -> dict[str, jax.Array]:
    """The weights a decode step of few rows reads packed (:mod:`agentgym_jax.prepacked`), keyed as
    :func:`generate_program` looks them up: one decode step of one row is traced for its packs only (XLA drops the
    step itself, whose result is not returned)."""
    model = nnx.merge(graphdef, state)
    cache = KVCache.zeros(model.config, 1, 2 * native_kernels.AMX_BLOCK, cache_dtype)
    with prepacked.recording(state) as made, native_kernels.packed_projections():
        hidden, _ = model.forward(jnp.zeros((1, 1), jnp.int32), cache=cache)
        model.logits(hidden)
    return dict(made)
