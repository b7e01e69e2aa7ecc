"""Read a llama.cpp GGUF checkpoint as a Hugging Face config, HF-named fp32 tensors and a tokenizer.

Supported architectures: ``llama`` (Llama, SmolLM2, Llama-3.x with its rope parameters recovered from
``rope_freqs``), ``qwen2`` (Qwen2, Qwen2.5) and ``qwen3`` (dense Qwen3). Tensors are dequantized one at a
time (any quantization the ``gguf`` package can dequantize), so a loader can place each tensor into its shard
before reading the next one. llama.cpp stores the query/key projections of ``llama`` models with their rotary
halves interleaved; that permutation is undone here, so the returned tensors are exactly what a Hugging Face
checkpoint would hold.

Example::

    ckpt = open_gguf("model.gguf")
    ckpt.config                      # dict, the content of a Hugging Face config.json
    for name, array in ckpt.iter_tensors():   # ("model.layers.0.self_attn.q_proj.weight", float32 array)
        ...
    tokenizer = ckpt.load_tokenizer()          # transformers tokenizer, with the GGUF's chat template
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from agentgym_jax.errors import CheckpointError

_MAGIC = b"GGUF"

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency rope factors (Llama-3.1+ rope scaling)
_HF_CLASSES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
               "qwen3": ("Qwen3ForCausalLM", "qwen3")}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_BLOCK_PATTERN = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_name_to_hf(gguf_name: str) -> str:
    """Map a llama.cpp tensor name (``blk.3.attn_q.weight``) to its Hugging Face name.

    Raises:
      CheckpointError: for a tensor this reader does not know (e.g. MoE experts).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_PATTERN.match(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    raise CheckpointError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in this reader; only dense "
        "llama/qwen2/qwen3 decoders are supported. Convert the model from its Hugging Face directory instead."
    )


def _shortest_float(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(repr(np.float32(value)).removeprefix("np.float32(").removesuffix(")"))


def unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of rotary halves in a q/k projection (rows = out features)."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise CheckpointError(f"q/k projection with {rows} rows cannot be split into {n_heads} heads")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class GGUFCheckpoint:
    """An opened, validated GGUF file; tensors are dequantized lazily, one at a time."""

    def __init__(self, path: Path, reader: Any) -> None:
        self.path = path
        self._reader = reader
        self._metadata_fields = {name: field for name, field in reader.fields.items()}
        self.architecture = str(self.metadata("general.architecture", required=True))
        if self.architecture not in _HF_CLASSES:
            raise CheckpointError(
                f"{path}: unsupported GGUF architecture {self.architecture!r}; supported: "
                f"{sorted(_HF_CLASSES)}. Use a Hugging Face directory of a Llama, Qwen2 or Qwen3 model."
            )
        self._tensors = {tensor.name: tensor for tensor in reader.tensors}
        self._hf_to_gguf = {gguf_name_to_hf(name): name for name in self._tensors if name != ROPE_FREQS}
        self.config = self._build_config()

    def metadata(self, key: str, default: Any = None, required: bool = False) -> Any:
        """One GGUF metadata value (e.g. ``"tokenizer.ggml.add_bos_token"``), or ``default`` when absent."""
        field = self._metadata_fields.get(key)
        if field is None:
            if required:
                raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is missing; the file is incomplete")
            return default
        return field.contents()

    def _arch_field(self, key: str, default: Any = None, required: bool = False) -> Any:
        return self.metadata(f"{self.architecture}.{key}", default, required)

    def _build_config(self) -> dict[str, Any]:
        arch_class, model_type = _HF_CLASSES[self.architecture]
        if self._arch_field("expert_count", 0):
            raise CheckpointError(f"{self.path}: mixture-of-experts GGUF models are not supported")
        hidden = int(self._arch_field("embedding_length", required=True))
        n_heads = int(self._arch_field("attention.head_count", required=True))
        n_kv = int(self._arch_field("attention.head_count_kv", n_heads))
        head_dim = int(self._arch_field("attention.key_length", hidden // n_heads))
        rotary_dim = int(self._arch_field("rope.dimension_count", head_dim))
        if rotary_dim != head_dim:
            raise CheckpointError(f"{self.path}: partial rotary embeddings ({rotary_dim} of {head_dim}) are not supported")
        embed = self._tensors.get("token_embd.weight")
        if embed is None:
            raise CheckpointError(f"{self.path}: GGUF has no 'token_embd.weight' tensor")
        vocab = int(embed.shape[-1])
        config: dict[str, Any] = {
            "architectures": [arch_class],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_field("feed_forward_length", required=True)),
            "num_hidden_layers": int(self._arch_field("block_count", required=True)),
            "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": int(self._arch_field("context_length", required=True)),
            "rms_norm_eps": _shortest_float(self._arch_field("attention.layer_norm_rms_epsilon", required=True)),
            "rope_theta": _shortest_float(self._arch_field("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(head_dim),
            "vocab_size": vocab,
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
            "use_cache": True,
        }
        if model_type == "llama":
            config["attention_bias"] = "blk.0.attn_q.bias" in self._tensors
            config["mlp_bias"] = False
            config["attention_dropout"] = 0.0
            config["pretraining_tp"] = 1
        else:
            if model_type == "qwen3":
                config["attention_bias"] = "blk.0.attn_q.bias" in self._tensors
            config["use_sliding_window"] = False
            config["sliding_window"] = None
            config["max_window_layers"] = config["num_hidden_layers"]
            config["attention_dropout"] = 0.0
        for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
            value = self.metadata(f"tokenizer.ggml.{name}_token_id")
            if value is not None:
                config[key] = int(value)
        return config

    def _rope_scaling(self, head_dim: int) -> dict[str, Any] | None:
        if ROPE_FREQS in self._tensors:
            return self._llama3_rope(head_dim)
        kind = self._arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        factor = self._arch_field("rope.scaling.factor")
        if kind == "linear" and factor is not None:
            return {"rope_type": "linear", "factor": float(factor)}
        raise CheckpointError(f"{self.path}: GGUF rope scaling {kind!r} is not supported; use the Hugging Face directory")

    def _llama3_rope(self, head_dim: int) -> dict[str, Any]:
        """Llama-3 rope parameters recovered from llama.cpp's per-frequency ``rope_freqs`` factors.

        llama.cpp stores ``factor`` for long wavelengths, 1 for short ones and ``1 / ((1 - s) / factor + s)`` in
        between, with ``s = (original / wavelength - low) / (high - low)``. ``s`` is linear in the inverse
        frequency, so two or more in-between factors give ``original`` and ``high`` once ``low_freq_factor`` is 1
        (as in every released Llama-3.x); the result is checked by recomputing all factors.
        """
        from gguf.quants import dequantize

        tensor = self._tensors[ROPE_FREQS]
        factors = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float64).reshape(-1)
        theta = float(self._arch_field("rope.freq_base", 10000.0))
        inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        unrecoverable = CheckpointError(
            f"{self.path}: the 'rope_freqs' tensor is not Llama-3 rope scaling this reader can recover (too few "
            "frequencies in the transition band, or factors off the llama3 formula); load the model's Hugging Face "
            "directory instead")
        if self.architecture != "llama" or factors.shape != inv_freq.shape:
            raise unrecoverable
        factor = float(factors.max())
        middle = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
        if factor <= 1 or middle.sum() < 2:
            raise unrecoverable
        smooth = (1 / factors[middle] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_freq[middle], smooth, 1)
        low = 1.0
        high = low - low / intercept
        original = slope * 2 * np.pi * (high - low)
        rope = {"rope_type": "llama3", "factor": _shortest_float(factor), "low_freq_factor": low,
                "high_freq_factor": round(float(high), 4), "original_max_position_embeddings": int(round(original))}
        wavelength = 2 * np.pi / inv_freq
        s = np.clip((rope["original_max_position_embeddings"] / wavelength - low) / (rope["high_freq_factor"] - low),
                    0.0, 1.0)
        recomputed = 1 / ((1 - s) / factor + s)
        if not np.allclose(recomputed, factors, rtol=1e-4):
            raise unrecoverable
        return rope

    @property
    def chat_template(self) -> str | None:
        """The chat template stored in the GGUF metadata, if any."""
        return self.metadata("tokenizer.chat_template")

    def tensor_names(self) -> list[str]:
        """Hugging Face names of all tensors, in file order."""
        return list(self._hf_to_gguf)

    def tensor_shape(self, hf_name: str) -> tuple[int, ...]:
        """Shape (Hugging Face / numpy order) of one tensor, without reading its data."""
        tensor = self._tensors[self._gguf_name(hf_name)]
        return tuple(int(d) for d in reversed(tensor.shape.tolist()))

    def _gguf_name(self, hf_name: str) -> str:
        try:
            return self._hf_to_gguf[hf_name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {hf_name!r} in this GGUF file") from None

    def read_tensor(self, hf_name: str) -> np.ndarray:
        """Dequantize one tensor to a float32 array in Hugging Face layout."""
        from gguf.quants import dequantize

        tensor = self._tensors[self._gguf_name(hf_name)]
        try:
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except NotImplementedError as err:
            raise CheckpointError(f"{self.path}: tensor {tensor.name!r}: {err}") from err
        array = array.reshape(self.tensor_shape(hf_name))
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")) and self.architecture == "llama":
            array = unpermute_rotary(array, self.config["num_attention_heads"])
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")) and self.architecture == "llama":
            array = unpermute_rotary(array, self.config["num_key_value_heads"])
        array = np.ascontiguousarray(array)
        return array if array.flags.writeable else array.copy()  # never hand out read-only views of the mmap

    def iter_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(hf_name, float32 array)`` one tensor at a time."""
        for hf_name in self._hf_to_gguf:
            yield hf_name, self.read_tensor(hf_name)

    def load_tokenizer(self) -> Any:
        """Build the Hugging Face tokenizer (with the GGUF's chat template) through transformers."""
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        except (ValueError, KeyError, OSError) as err:
            raise CheckpointError(f"{self.path}: transformers cannot build a tokenizer from this GGUF: {err}") from err


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open and validate a GGUF file.

    Raises:
      CheckpointError: the path is missing, not a GGUF file, truncated or corrupt, or the architecture
        is not ``llama``/``qwen2``/``qwen3``.
    """
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != _MAGIC:
        raise CheckpointError(
            f"{path} is not a GGUF file (its first bytes are {magic!r}, expected {_MAGIC!r}); pass a .gguf file "
            "exported by llama.cpp, or a Hugging Face directory"
        )
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, struct.error, TypeError) as err:
        raise CheckpointError(f"{path}: GGUF file is truncated or corrupt ({err}); download or export it again") from err
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise CheckpointError(
                f"{path}: GGUF file is truncated: tensor {tensor.name!r} needs bytes up to {end}, the file has {size}"
            )
    return GGUFCheckpoint(path, reader)


def read_gguf(path: str | Path) -> tuple[dict[str, Any], Iterator[tuple[str, np.ndarray]], Any]:
    """Read a GGUF file as ``(hf_config_dict, iterator of (hf_name, float32 array), hf_tokenizer)``."""
    checkpoint = open_gguf(path)
    return checkpoint.config, checkpoint.iter_tensors(), checkpoint.load_tokenizer()
