"""Low-rank adapters (LoRA) on the policy's linear projections, and their exports.

Every projection of the model is a :class:`Linear` (parameters ``kernel`` [in, out] and ``bias``, Hugging Face's
names). A projection named in ``ModelConfig.lora_targets`` also holds ``lora_a`` [in, r] and ``lora_b`` [r, out]
(:class:`LoRAParam`) and computes ``x @ kernel + (x @ lora_a) @ lora_b * alpha / r``. ``lora_b`` starts at zero,
so a fresh adapter leaves the model's outputs exactly as they were.

* :func:`without_adapters`: the same state with every ``lora_b`` zeroed: the base model, e.g. the KL reference,
  sharing the base arrays (no second copy of the weights).
* :func:`merged_kernels`: ``kernel + lora_a @ lora_b * scale`` per projection, for a merged Hugging Face export.
* :func:`write_peft_files`: a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
  that ``peft.PeftModel.from_pretrained(base, dir)`` loads (``hf.export_model(..., adapter_only=True)``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentgym_jax.errors import ConfigError
from agentgym_jax.mixed_matmul import mixed_dot

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAParam(nnx.Param):
    """An adapter parameter (``lora_a`` / ``lora_b``): what a LoRA run trains."""


def check_lora(rank: int, alpha: float, targets: tuple[str, ...]) -> None:
    """Raises a clear error for unusable adapter settings."""
    if rank < 0:
        raise ConfigError(f"lora_rank must be >= 0 (0: no adapters), got {rank}")
    unknown = sorted(set(targets) - set(PROJECTIONS))
    if unknown:
        raise ConfigError(f"lora_targets {unknown} are not projections of this model; choose from {PROJECTIONS}")
    if rank and not targets:
        raise ConfigError(f"lora_rank={rank} needs lora_targets, e.g. ('q_proj', 'v_proj') or all of {PROJECTIONS}")
    if rank and alpha <= 0:
        raise ConfigError(f"lora_alpha must be positive, got {alpha}")


class Linear(nnx.Module):
    """``x @ kernel (+ bias)``, plus a low-rank update when built with ``rank > 0``."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype: Any, param_dtype: Any, rngs: nnx.Rngs,
                 rank: int = 0, alpha: float = 0.0):
        self.kernel = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (d_in, d_out), param_dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype)) if bias else None
        self.dtype = dtype
        self.scale = alpha / rank if rank else 0.0
        if rank:
            bound = 1.0 / np.sqrt(d_in)  # PEFT's default A initialisation (Kaiming-uniform, a=sqrt(5))
            self.lora_a = LoRAParam(jax.random.uniform(rngs.params(), (d_in, rank), jnp.float32, -bound, bound))
            self.lora_b = LoRAParam(jnp.zeros((rank, d_out), jnp.float32))
        else:
            self.lora_a = self.lora_b = None

    def plain_kernel(self) -> jax.Array | None:
        """The kernel in the compute dtype when this layer is ``x @ kernel`` alone (no adapter, no bias), else
        None: what a fused kernel may take in its place."""
        if self.lora_a is not None or self.bias is not None:
            return None
        return self.kernel[...].astype(self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        y = _dot(x, self.kernel[...].astype(self.dtype))
        if self.lora_a is not None:
            low = _dot(x, self.lora_a[...].astype(self.dtype))
            y = y + _dot(low, self.lora_b[...].astype(self.dtype)) * jnp.asarray(self.scale, self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def _dot(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x @ kernel`` accumulated in fp32, in ``x``'s dtype, its gradients' products too (:mod:`mixed_matmul`).
    Asking for the fp32 result is also what lets XLA's CPU backend use its native bf16 kernels (a bf16-output dot
    is computed by upcasting both sides)."""
    return mixed_dot(x, kernel)


def is_adapter_path(path: str) -> bool:
    return path.endswith((".lora_a", ".lora_b"))


def initial_adapter(path: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Deterministic initial value of an adapter parameter loaded beside base weights (``lora_b`` zeros)."""
    if path.endswith(".lora_b"):
        return np.zeros(shape, np.float32)
    rng = np.random.default_rng([seed, *path.encode()])
    bound = 1.0 / np.sqrt(shape[0])
    return rng.uniform(-bound, bound, shape).astype(np.float32)


def without_adapters(state: nnx.State) -> nnx.State:
    """``state`` with every ``lora_b`` zeroed: the base model's outputs, base arrays shared, not copied."""
    flat = []
    for key, variable in nnx.to_flat_state(state):
        if key[-1] == "lora_b":
            variable = variable.replace(jnp.zeros_like(variable[...]))
        flat.append((key, variable))
    return nnx.from_flat_state(flat)


def adapter_arrays(model: nnx.Module) -> Iterator[tuple[str, np.ndarray, np.ndarray, float]]:
    """``(module path, lora_a, lora_b, scale)`` of every adapted projection, gathered to host numpy."""
    for path, module in nnx.iter_modules(model):
        if isinstance(module, Linear) and module.lora_a is not None:
            name = ".".join(map(str, path))
            yield name, np.asarray(jax.device_get(module.lora_a[...])), np.asarray(
                jax.device_get(module.lora_b[...])), module.scale


def merged_kernels(model: nnx.Module) -> dict[str, np.ndarray]:
    """Our ``<module>.kernel`` path -> kernel with its adapter merged in (only adapted projections)."""
    merged = {}
    for name, a, b, scale in adapter_arrays(model):
        module = model
        for part in name.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        kernel = np.asarray(jax.device_get(module.kernel[...]), np.float32)
        merged[f"{name}.kernel"] = (kernel + (a @ b) * scale).astype(kernel.dtype)
    return merged


def write_peft_files(model: nnx.Module, out: str | os.PathLike, base_model: str = "") -> Path:
    """Writes ``model``'s adapters as PEFT LoRA files into the directory ``out`` (what
    ``PeftModel.from_pretrained`` reads); ``hf.export_model(..., adapter_only=True)`` wraps it safely."""
    from safetensors.numpy import save_file

    config = model.config
    if not config.lora_rank:
        raise ConfigError("the model has no adapters (lora_rank=0); export the full weights instead")
    out = Path(out)
    tensors = {}
    for name, a, b, _ in adapter_arrays(model):
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.T)  # PEFT: A [r, in], B [out, r]
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.T)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.lora_rank, "lora_alpha": config.lora_alpha,
        "target_modules": sorted(config.lora_targets), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_model,
        "modules_to_save": None, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
