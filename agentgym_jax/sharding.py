"""Device mesh, partition rules for every parameter, and activation sharding constraints.

The mesh has three named axes:

* ``data``   - pure data parallelism (parameters replicated),
* ``fsdp``   - data parallelism with parameters sharded along their hidden dimension (ZeRO-3 style),
* ``tensor`` - tensor (Megatron) parallelism: attention heads, MLP columns and vocabulary are split.

The batch of every activation is split over ``("data", "fsdp")``. The same rules serve sampling and training:
the sampler and the train step read the very same sharded parameter arrays.

Model code calls :func:`constrain` on its main activations; it is a no-op unless a mesh is active
(``with use_mesh(mesh): ...``), so the model also runs unsharded on one device.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")

# Activation layouts, by name. Shapes: [batch, seq, ...].
ACTIVATIONS: dict[str, P] = {
    "hidden": P(BATCH, None, None),  # [B, S, D]
    "heads": P(BATCH, None, "tensor", None),  # [B, S, N, H]
    "mlp": P(BATCH, None, "tensor"),  # [B, S, F]
    "logits": P(BATCH, None, "tensor"),  # [B, S, V]
    "kv_cache": P(BATCH, "tensor", None, None),  # keys [B, K, H, T], values [B, K, T, H]
    "tokens": P(BATCH, None),  # [B, S]
    "rows": P(BATCH),  # [B]
}

# Parameter partition rules: (regex on the dotted parameter path, spec). First match wins.
# Kernels are [in, out] (flax convention; Hugging Face stores the transpose).
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"embed_tokens\.weight$", P("tensor", "fsdp")),  # [V, D]
    (r"self_attn\.(q|k|v)_proj\.kernel$", P("fsdp", "tensor")),  # [D, heads*H]
    (r"self_attn\.(q|k|v)_proj\.bias$", P("tensor")),
    (r"self_attn\.o_proj\.kernel$", P("tensor", "fsdp")),  # [heads*H, D]
    (r"self_attn\.o_proj\.bias$", P(None)),
    (r"mlp\.(gate|up)_proj\.kernel$", P("fsdp", "tensor")),  # [D, F]
    (r"mlp\.(gate|up)_proj\.bias$", P("tensor")),
    (r"mlp\.down_proj\.kernel$", P("tensor", "fsdp")),  # [F, D]
    (r"mlp\.down_proj\.bias$", P(None)),
    # LoRA adapters follow their projection: lora_a [in, r] splits like the kernel's input axis, lora_b [r, out]
    # like its output axis.
    (r"((q|k|v)_proj|(gate|up)_proj)\.lora_a$", P("fsdp", None)),
    (r"((q|k|v)_proj|(gate|up)_proj)\.lora_b$", P(None, "tensor")),
    (r"(o_proj|down_proj)\.lora_a$", P("tensor", None)),
    (r"(o_proj|down_proj)\.lora_b$", P(None, "fsdp")),
    (r"norm\.weight$|layernorm\.weight$", P(None)),
    (r"lm_head\.kernel$", P("fsdp", "tensor")),  # [D, V]
    (r"value_head\.kernel$", P("fsdp", None)),  # critic head [D, 1]
    (r"value_head\.bias$", P(None)),
)


def make_mesh(shape: Sequence[int] = (1, 1, 1), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all devices)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or any(s < 1 for s in shape):
        raise ConfigError(f"mesh shape must be three positive sizes (data, fsdp, tensor), got {shape}")
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(shape) != len(devices):
        raise ConfigError(
            f"mesh shape {shape} needs {math.prod(shape)} devices but {len(devices)} are available; "
            "choose axis sizes whose product is the device count (on CPU, simulate devices with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[Mesh | None]:
    """Makes ``mesh`` the active mesh for :func:`constrain` (and for jit) inside the block."""
    if mesh is None:
        yield None
        return
    with jax.set_mesh(mesh):
        yield mesh


def active_mesh_size() -> int:
    """Devices of the mesh active now (1 when none is)."""
    mesh = _active_mesh()
    return 1 if mesh is None else mesh.size


def _active_mesh() -> Any:
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def constrain(x: jax.Array, layout: str) -> jax.Array:
    """Constrains activation ``x`` to the named layout when a mesh is active; identity otherwise."""
    if _active_mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, ACTIVATIONS[layout])


def param_spec(path: str) -> P:
    """The partition spec of the parameter at dotted ``path`` (e.g. ``model.layers.0.mlp.up_proj.kernel``)."""
    for pattern, spec in PARAM_RULES:
        if re.search(pattern, path):
            return spec
    raise ConfigError(f"no partition rule matches parameter {path!r}; add one to sharding.PARAM_RULES")


def path_to_str(path: Sequence[Any]) -> str:
    """Dotted string for a jax/nnx tree path."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def _axis_size(mesh: Mesh, axes: Any) -> int:
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[name] for name in names)


def check_param_divisibility(path: str, shape: Sequence[int], mesh: Mesh) -> None:
    """Raises a clear error when a parameter dimension cannot be split by its mesh axes."""
    spec = param_spec(path)
    for dim, axes in enumerate(spec):
        size = _axis_size(mesh, axes)
        if shape[dim] % size:
            raise ConfigError(
                f"parameter {path} has dimension {dim} of size {shape[dim]}, which is not divisible by the "
                f"mesh axis {axes!r} of size {size}; choose a mesh whose {axes!r} size divides {shape[dim]}"
            )


def check_model_fits_mesh(config: Any, mesh: Mesh) -> None:
    """Checks the model's dimensions against the mesh, naming the dimension that does not divide."""
    tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
    checks = [
        ("num_attention_heads", config.num_attention_heads, "tensor", tensor),
        ("num_key_value_heads", config.num_key_value_heads, "tensor", tensor),
        ("intermediate_size", config.intermediate_size, "tensor", tensor),
        ("vocab_size", config.vocab_size, "tensor", tensor),
        ("hidden_size", config.hidden_size, "fsdp", fsdp),
    ]
    for name, value, axis, size in checks:
        if value % size:
            raise ConfigError(
                f"model dimension {name}={value} is not divisible by the mesh's {axis!r} axis of size {size}; "
                f"use a {axis!r} size that divides {value} (mesh shape is data x fsdp x tensor = "
                f"{tuple(mesh.shape.values())})"
            )


def batch_rows(mesh: Mesh | None) -> int:
    """How many ways batch rows are split: the size of the ``(data, fsdp)`` axes (1 without a mesh)."""
    return 1 if mesh is None else _axis_size(mesh, BATCH)


def check_batch_fits_mesh(batch_size: int, mesh: Mesh | None) -> None:
    """Batch rows are split over ``(data, fsdp)``; the row count must divide evenly."""
    if mesh is None:
        return
    size = batch_rows(mesh)
    if batch_size % size:
        raise ConfigError(
            f"batch of {batch_size} rows is not divisible by data x fsdp = {size}; "
            f"use a batch size that is a multiple of {size}"
        )


def named_sharding(mesh: Mesh, layout: str) -> NamedSharding:
    """The ``NamedSharding`` of a named activation layout."""
    return NamedSharding(mesh, ACTIVATIONS[layout])


def param_sharding(mesh: Mesh, path: str, shape: Sequence[int]) -> NamedSharding:
    """The ``NamedSharding`` of one parameter, after checking that its dimensions divide."""
    check_param_divisibility(path, shape, mesh)
    return NamedSharding(mesh, param_spec(path))
