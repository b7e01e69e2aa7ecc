"""A decoder LM's architecture settings (``ModelConfig``, read from a Hugging Face ``config.json``) and the
compute dtypes by name."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from agentgym_jax.errors import ConfigError
from agentgym_jax.lora import check_lora

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Rope parameters each rope type needs (read at load time, so a missing one is named before anything runs).
_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def to_dtype(name: Any) -> Any:
    """``"float32"``/``"bfloat16"`` (or a jnp dtype) to a jnp dtype, with a clear error for anything else."""
    if not isinstance(name, str):
        return jnp.dtype(name)
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of a decoder LM; built from a Hugging Face ``config.json`` dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # hashable copy of HF's rope parameters
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each query/key head before RoPE
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype
    remat: bool = False  # rematerialize each decoder layer in the backward pass
    frozen_layers: int = 0  # the first N decoder layers pass no gradient back (training only the layers above)
    lora_rank: int = 0  # > 0: low-rank adapters on lora_targets (agentgym_jax/lora.py)
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Builds a config from a Hugging Face config dict, rejecting architectures we do not implement."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported architecture model_type={model_type!r} (architectures={hf.get('architectures')}); "
                f"agentgym-jax implements {SUPPORTED_MODEL_TYPES} (Llama, SmolLM2, Llama-3.x, Qwen2, Qwen2.5, Qwen3 "
                "dense)"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act={hf.get('hidden_act')!r}; only 'silu' (SwiGLU) is implemented")
        if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window", False):
            raise ConfigError(f"{model_type} sliding-window attention is not implemented; set use_sliding_window=false")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ConfigError(f"config.json lacks required keys {missing}")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"unsupported rope type {rope_type!r}; implemented: {SUPPORTED_ROPE_TYPES}")
        rope["rope_type"] = rope_type
        rope.pop("type", None)
        missing_rope = [k for k in _ROPE_KEYS.get(rope_type, ()) if k not in rope]
        if missing_rope:
            raise ConfigError(f"config.json: rope type {rope_type!r} needs {list(missing_rope)} in rope_scaling "
                              f"(has {sorted(rope)}); add them from the model's original config")
        heads = int(hf["num_attention_heads"])
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        fields = dict(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else tuple(sorted(rope.items())),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
        )
        fields.update(overrides)
        config = cls(**fields)
        config.validate()
        return config

    def validate(self) -> None:
        """Raises a clear error for inconsistent sizes or dtypes."""
        to_dtype(self.param_dtype), to_dtype(self.dtype)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        check_lora(self.lora_rank, self.lora_alpha, tuple(self.lora_targets))

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict of this architecture."""
        rope = {"rope_type": "default"} if self.rope_scaling is None else dict(self.rope_scaling)
        hf: dict[str, Any] = dict(
            model_type=self.model_type,
            architectures=[_ARCHITECTURES[self.model_type]],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            pad_token_id=self.pad_token_id,
            torch_dtype=self.param_dtype,
        )
        if self.rope_scaling is not None:
            hf["rope_scaling"] = rope
        if self.model_type == "llama":
            hf.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        elif self.model_type == "qwen3":
            hf.update(attention_bias=self.qkv_bias, use_sliding_window=False)
        else:
            hf.update(use_sliding_window=False)
        return hf

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids as a tuple (possibly empty)."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    def num_params(self) -> int:
        """Parameter count (matching Hugging Face's count for the same architecture)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * h, self.num_key_value_heads * h
        attn = d * (q + 2 * kv) + q * d + (q + 2 * kv if self.qkv_bias else 0) + (d if self.o_bias else 0)
        mlp = 3 * d * f + ((2 * f + d) if self.mlp_bias else 0)
        layer = attn + mlp + 2 * d + (2 * h if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_hidden_layers * layer + d + head


# ----------------------------------------------------------------------------------------------- RoPE
