"""The policy: one Flax NNX decoder LM for the Llama, Qwen2 and Qwen3 families.

GQA attention with RoPE (default, linear and Llama-3 scaling), RMSNorm, SwiGLU MLP, optional QKV bias (Qwen2),
optional per-head RMSNorm of queries and keys before RoPE (Qwen3), tied or untied embeddings. Module and parameter names mirror Hugging Face's, e.g.
``model.layers.3.self_attn.q_proj.kernel`` is the transpose of HF's ``model.layers.3.self_attn.q_proj.weight``.

Two ways to run it:

* teacher-forced over right-padded rows: ``hidden, _ = model.forward(tokens, positions)``;
* against a KV cache (sampling): ``hidden, cache = model.forward(tokens, positions, cache=cache)`` writes each
  row's new keys/values at that row's own length (``cache.lengths``) and attends to everything before.

Attention is causal by cache slot; rows are right-padded, so a real token never sees a padding slot. Packed rows
(several trajectories per row, see :mod:`agentgym_jax.packing`) pass :class:`Segments` to narrow it further.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from agentgym_jax import attention, native_kernels, sharding
from agentgym_jax.attention import Segments
from agentgym_jax.errors import ConfigError
from agentgym_jax.lora import Linear
from agentgym_jax.mixed_matmul import mixed_dot
from agentgym_jax.model_config import ModelConfig, to_dtype  # noqa: F401 - also imported from here by callers


def rope_inverse_frequencies(config: ModelConfig) -> jax.Array:
    """Per-pair inverse frequencies [head_dim // 2], with linear or Llama-3 scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if config.rope_scaling is None:
        return inv_freq
    rope = dict(config.rope_scaling)
    factor = float(rope.get("factor", 1.0))
    if rope["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, smoothed, scaled)


# ----------------------------------------------------------------------------------------------- KV cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer keys [B, K, H, T] and values [B, K, T, H] of ``dtype``, and each row's filled length [B] (its
    next write slot).

    The layouts are the decode step's (:func:`attention.attend_one_query`): both of its reductions then run over
    a non-minor axis with the minor one vectorized, and each (row, head) is read contiguously. Slots before heads
    made XLA transpose every layer's whole cache on every step. 16-bit entries are held as raw bits
    (:func:`attention.storage_dtype`)."""

    keys: list[jax.Array]
    values: list[jax.Array]
    lengths: jax.Array
    dtype: Any = dataclasses.field(default=jnp.float32, metadata=dict(static=True))
    # Attention reads only the first ``window`` slots (None: all); the caller picks it so no row passes it.
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int, dtype: Any = None) -> "KVCache":
        """An empty cache of ``length`` slots per row, in ``dtype`` (default: the compute dtype)."""
        dtype = to_dtype(dtype or config.dtype)
        heads, head_dim, bits = config.num_key_value_heads, config.head_dim, attention.storage_dtype(dtype)
        zeros = lambda *shape: sharding.constrain(jnp.zeros((batch, heads, *shape), bits), "kv_cache")
        return cls(
            keys=[zeros(head_dim, length) for _ in range(config.num_hidden_layers)],
            values=[zeros(length, head_dim) for _ in range(config.num_hidden_layers)],
            lengths=jnp.zeros((batch,), jnp.int32),
            dtype=dtype,
        )

    def layer(self, i: int) -> attention.LayerCache:
        """Layer ``i``'s entries."""
        return attention.LayerCache(self.keys[i], self.values[i], self.dtype, self.window)

    @property
    def capacity(self) -> int:
        """Slots per row."""
        return self.values[0].shape[attention.VALUE_SLOT_AXIS]

    @staticmethod
    def nbytes(config: ModelConfig, batch: int, length: int, dtype: Any = None) -> int:
        """Memory of a cache for ``batch`` rows of ``length`` slots."""
        itemsize = jnp.dtype(to_dtype(dtype or config.dtype)).itemsize
        per_layer = 2 * batch * length * config.num_key_value_heads * config.head_dim * itemsize
        return config.num_hidden_layers * per_layer + 4 * batch


# ----------------------------------------------------------------------------------------------- modules


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in fp32, as Hugging Face does; parameter ``weight``."""

    def __init__(self, dim: int, eps: float, param_dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


class Embedding(nnx.Module):
    """Token embedding table ``weight`` [V, D] (HF layout), also usable as a tied output head."""

    def __init__(self, vocab: int, dim: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), param_dtype) * 0.02)
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return _embed(self.weight[...], tokens).astype(self.dtype)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """Logits of a tied head: ``hidden @ weight.T``."""
        return mixed_dot(hidden.astype(self.dtype), self.weight[...].astype(self.dtype), transposed=True,
                         out_dtype=jnp.float32)


@jax.custom_vjp
def _embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``table[tokens]``. A 16-bit table is gathered as its raw bits: XLA's CPU backend has no bf16 gather and
    converted the whole table to fp32 first (24 ms per generate call for SmolLM2's 49k x 576 table)."""
    bits = attention.to_storage(table)
    return jax.lax.bitcast_convert_type(jnp.take(bits, tokens, axis=0), table.dtype)


def _embed_forward(table, tokens):
    return _embed(table, tokens), (table, tokens)  # the table is a parameter: kept alive anyway


def _embed_backward(residuals, g):
    table, tokens = residuals
    _, pull = jax.vjp(lambda t: jnp.take(t, tokens, axis=0), table)  # jnp.take's gradient: a scatter-add
    return pull(g)[0], None


_embed.defvjp(_embed_forward, _embed_backward)


def _linear(d_in: int, d_out: int, bias: bool, config: ModelConfig, rngs: nnx.Rngs, name: str = "") -> Linear:
    adapted = config.lora_rank and name in config.lora_targets
    return Linear(d_in, d_out, bias=bias, dtype=to_dtype(config.dtype), param_dtype=to_dtype(config.param_dtype),
                  rngs=rngs, rank=config.lora_rank if adapted else 0, alpha=config.lora_alpha)


def decodes_natively(cache_dtype: Any) -> bool:
    """Whether a step over a cache of ``cache_dtype`` runs the native cache kernels, a decode step
    :func:`native_kernels.decode_attention` (which reads only each row's own slots) and a prefill piece
    :func:`native_kernels.cache_write`: an fp32 or bf16 cache, on CPU outside a mesh of several devices
    (:func:`native_kernels.enabled`). Decided when a program is traced."""
    return jnp.dtype(cache_dtype) in (jnp.float32, jnp.bfloat16) and native_kernels.enabled()


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optionally against a KV cache."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, h = config.hidden_size, config.head_dim
        self.q_proj = _linear(d, config.num_attention_heads * h, config.qkv_bias, config, rngs, "q_proj")
        self.k_proj = _linear(d, config.num_key_value_heads * h, config.qkv_bias, config, rngs, "k_proj")
        self.v_proj = _linear(d, config.num_key_value_heads * h, config.qkv_bias, config, rngs, "v_proj")
        self.o_proj = _linear(config.num_attention_heads * h, d, config.o_bias, config, rngs, "o_proj")
        if config.qk_norm:
            self.q_norm = RMSNorm(h, config.rms_norm_eps, to_dtype(config.param_dtype))
            self.k_norm = RMSNorm(h, config.rms_norm_eps, to_dtype(config.param_dtype))
        self.qk_norm = config.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, h

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        inv_freq: jax.Array,
        layer_cache: attention.LayerCache | None,
        cache_lengths: jax.Array | None,
        segments: Segments | None = None,
    ) -> tuple[jax.Array, attention.LayerCache | None]:
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = sharding.constrain(attention.apply_rope(q, positions, inv_freq), "heads")
        k = sharding.constrain(attention.apply_rope(k, positions, inv_freq), "heads")
        v = sharding.constrain(v, "heads")
        q = q.reshape(b, s, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        scale = 1.0 / math.sqrt(self.head_dim)
        if layer_cache is not None and s == 1 and decodes_natively(layer_cache.dtype):
            # a decode step: the native kernel writes the new entries into the cache and attends over it
            out, k_all, v_all = native_kernels.decode_attention(
                q, layer_cache.keys, layer_cache.values, k, v, cache_lengths, scale, layer_cache.dtype)
            layer_cache = layer_cache._replace(keys=sharding.constrain(k_all, "kv_cache"),
                                               values=sharding.constrain(v_all, "kv_cache"))
        else:
            out, layer_cache = self._attend(q, k, v, scale, layer_cache, cache_lengths, segments)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim)), layer_cache

    @staticmethod
    def _attend(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, layer_cache: attention.LayerCache | None,
                cache_lengths: jax.Array | None, segments: Segments | None
                ) -> tuple[jax.Array, attention.LayerCache | None]:
        """Attention in JAX for q [B, S, K, G, H] and the new k, v [B, S, K, H]: with a cache, after writing them
        into it (at slots ``cache_lengths + s``); without, causally over themselves."""
        b, s = q.shape[:2]
        query_slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if layer_cache is not None:
            query_slots = query_slots + cache_lengths[:, None]
            if decodes_natively(layer_cache.dtype):  # the same write, as copies rather than XLA's scatter
                k_all, v_all = native_kernels.cache_write(layer_cache.keys, layer_cache.values, k, v, cache_lengths,
                                                          layer_cache.dtype)
            else:
                k_all = attention.write_slots(layer_cache.keys, query_slots, k, layer_cache.dtype,
                                              attention.KEY_SLOT_AXIS)
                v_all = attention.write_slots(layer_cache.values, query_slots, v, layer_cache.dtype,
                                              attention.VALUE_SLOT_AXIS)
            k_all, v_all = sharding.constrain(k_all, "kv_cache"), sharding.constrain(v_all, "kv_cache")
            layer_cache = layer_cache._replace(keys=k_all, values=v_all)
            k = attention.from_storage(layer_cache.readable(k_all, attention.KEY_SLOT_AXIS), layer_cache.dtype)
            v = attention.from_storage(layer_cache.readable(v_all, attention.VALUE_SLOT_AXIS), layer_cache.dtype)
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        else:
            k, v = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # the cache's layouts
        key_slots = jnp.arange(v.shape[attention.VALUE_SLOT_AXIS], dtype=jnp.int32)
        allowed = key_slots[None, None, :] <= query_slots[:, :, None]  # [B, S, T]
        if segments is not None:  # teacher-forced packed rows (no cache): S == T
            allowed = allowed & segments.allowed()
        if s > 1 and native_kernels.amx_attention_applies(q, k, v):
            attend = native_kernels.amx_attention
        elif s > 1 and native_kernels.bf16_attention_applies(q, k, v):
            attend = native_kernels.bf16_attention
        elif s == 1:
            attend = attention.attend_one_query
        else:  # a teacher-forced row (no cache) attends to its own keys, causally
            attend = attention.attend if layer_cache is not None else attention.attend_causal
        return attend(q, k, v, allowed, scale), layer_cache


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(d, f, config.mlp_bias, config, rngs, "gate_proj")
        self.up_proj = _linear(d, f, config.mlp_bias, config, rngs, "up_proj")
        self.down_proj = _linear(f, d, config.mlp_bias, config, rngs, "down_proj")

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_proj.plain_kernel(), self.up_proj.plain_kernel()
        fused = None
        if gate is not None and up is not None:  # sampling: one pass, no products written out
            x_in = x.astype(gate.dtype)
            if native_kernels.amx_swiglu_applies(x_in, gate, up):
                fused = native_kernels.amx_swiglu
            elif native_kernels.bf16_swiglu_applies(x_in, gate, up):
                fused = native_kernels.bf16_swiglu
        if fused is not None:
            gated = fused(x_in, gate, up)
        else:
            gated = swiglu(self.gate_proj(x), self.up_proj(x))
        return self.down_proj(sharding.constrain(gated, "mlp"))


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``, computed in fp32 with the sigmoid as ``0.5 tanh(x / 2) + 0.5`` and rounded once to the
    inputs' dtype. XLA's CPU backend ran ``jax.nn.silu`` (an exponential and a division) per bf16 op, 1.7x slower
    over a prefill's [4096, 1536] activations; its tanh is a vectorized rational function."""
    g = gate.astype(jnp.float32)
    return (g * (0.5 * jnp.tanh(0.5 * g) + 0.5) * up.astype(jnp.float32)).astype(gate.dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm attention block then pre-norm MLP block, both residual."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        param_dtype = to_dtype(config.param_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, positions, inv_freq, layer_cache, cache_lengths, segments=None):
        attn, layer_cache = self.self_attn(self.input_layernorm(x), positions, inv_freq, layer_cache, cache_lengths,
                                           segments)
        x = sharding.constrain(x + attn, "hidden")
        x = sharding.constrain(x + self.mlp(self.post_attention_layernorm(x)), "hidden")
        return x, layer_cache


class Backbone(nnx.Module):
    """Embeddings, decoder layers and the final norm (HF's ``model.*``)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, dtype=to_dtype(config.dtype),
            param_dtype=to_dtype(config.param_dtype), rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(config, rngs) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, to_dtype(config.param_dtype))


class DecoderLM(nnx.Module):
    """A causal LM: ``Backbone`` plus an output head (tied to the embeddings or a separate ``lm_head``)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs | None = None):
        config.validate()
        rngs = rngs or nnx.Rngs(0)
        self.config = config
        self.model = Backbone(config, rngs)
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, config, rngs)

    def forward(
        self, tokens: jax.Array, positions: jax.Array | None = None, cache: KVCache | None = None,
        segments: Segments | None = None, trunk: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Final hidden states [B, S, D] for ``tokens`` [B, S] (right-padded rows), and the updated cache.

        Without a cache, row b's token s sits at slot s. With a cache, it is written at slot
        ``cache.lengths[b] + s``; the caller advances ``lengths`` by the number of real new tokens.
        ``positions`` (RoPE positions) default to the slots. ``segments`` (packed rows, no cache) restricts
        attention to each token's own trajectory. ``trunk`` (no cache): :meth:`trunk`'s output for these tokens,
        which replaces the embedding and the frozen layers.
        """
        if segments is not None and cache is not None:
            raise ConfigError("segments describe packed teacher-forced rows; they cannot be used with a KV cache")
        if trunk is not None and cache is not None:
            raise ConfigError("a cached trunk stands for teacher-forced rows; it cannot be used with a KV cache")
        positions = self._positions(tokens, positions, cache)
        if trunk is None:
            x, cache = self._layers(self.model.embed_tokens(tokens), positions, cache, segments, 0)
        else:
            x, cache = self._layers(trunk, positions, None, segments, self.config.frozen_layers)
        return self.model.norm(x), cache

    def trunk(self, tokens: jax.Array, positions: jax.Array | None = None,
              segments: Segments | None = None) -> jax.Array:
        """Hidden states [B, S, D] after the frozen layers (``config.frozen_layers``), no gradient. They depend
        only on frozen weights when the embeddings are frozen too, so a step can compute them once for all its
        updates (:meth:`forward`'s ``trunk``)."""
        positions = self._positions(tokens, positions, None)
        x, _ = self._layers(self.model.embed_tokens(tokens), positions, None, segments, 0,
                            stop=self.config.frozen_layers)
        return jax.lax.stop_gradient(x)

    def _positions(self, tokens: jax.Array, positions: jax.Array | None, cache: KVCache | None) -> jax.Array:
        if positions is not None:
            return positions
        b, s = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        return positions if cache is None else positions + cache.lengths[:, None]

    def _layers(self, x: jax.Array, positions: jax.Array, cache: KVCache | None, segments: Segments | None,
                start: int, stop: int | None = None) -> tuple[jax.Array, KVCache | None]:
        """Decoder layers ``start`` (an index) up to ``stop`` (default: the last) over hidden states ``x``."""
        inv_freq = rope_inverse_frequencies(self.config)
        x = sharding.constrain(x, "hidden")
        new_keys, new_values = [], []
        for i, layer in enumerate(self.model.layers[start:stop], start):
            layer_cache = None if cache is None else cache.layer(i)
            lengths = None if cache is None else cache.lengths
            if self.config.remat and cache is None:
                # Functional remat over the layer's state: its arrays may come from several traces (LoRA: the
                # differentiated adapters and the fixed base weights), which nnx.remat's in-place updates refuse.
                graphdef, layer_state = nnx.split(layer)
                run = jax.checkpoint(lambda state, *a, graphdef=graphdef: nnx.merge(graphdef, state)(*a))
                x, layer_cache = run(layer_state, x, positions, inv_freq, layer_cache, lengths, segments)
            else:
                x, layer_cache = layer(x, positions, inv_freq, layer_cache, lengths, segments)
            if i + 1 == self.config.frozen_layers:  # no backward pass below this point
                x = jax.lax.stop_gradient(x)
            if layer_cache is not None:
                new_keys.append(layer_cache.keys)
                new_values.append(layer_cache.values)
        new_cache = None if cache is None else dataclasses.replace(cache, keys=new_keys, values=new_values)
        return x, new_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits [B, S, V] from hidden states [B, S, D]."""
        if self.config.tie_word_embeddings:
            out = self.model.embed_tokens.attend(hidden)
        else:
            out = self.lm_head(hidden)
        return sharding.constrain(out.astype(jnp.float32), "logits")

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Teacher-forced logits [B, S, V] for right-padded ``tokens`` [B, S]."""
        hidden, _ = self.forward(tokens, positions)
        return self.logits(hidden)


def abstract_model(config: ModelConfig) -> DecoderLM:
    """The model's structure with shape-only parameters (nothing allocated), for loading checkpoints."""
    return nnx.eval_shape(lambda: DecoderLM(config, nnx.Rngs(0)))


def parameter_paths(model: nnx.Module) -> dict[str, Any]:
    """Dotted path -> parameter variable, for every ``nnx.Param`` of ``model``."""
    state = nnx.state(model, nnx.Param)
    flat = {}
    for path, leaf in nnx.to_flat_state(state):
        flat[".".join(str(p) for p in path)] = leaf
    return flat
