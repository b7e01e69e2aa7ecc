"""Hugging Face import and export of the policy.

Import reads a local Hugging Face directory (``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``) or a GGUF file, tensor by tensor, placing each tensor straight into its shards:
the host never holds a second full copy of the weights. Export writes a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads with no missing or unexpected weights.

Our parameter names are Hugging Face's, with ``kernel`` ([in, out]) where HF has a Linear ``weight`` ([out, in]).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from agentgym_jax import lora, sharding
from agentgym_jax.errors import CheckpointError
from agentgym_jax.model import DecoderLM, ModelConfig, abstract_model, to_dtype

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
# Tensors some checkpoints carry that carry no learned state of ours.
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
EXPORT_MARKER = ".agentgym-export.json"  # marks a directory an export of this tool wrote (may be replaced)


def our_to_hf_name(path: str) -> str:
    """``model.layers.0.mlp.up_proj.kernel`` -> ``model.layers.0.mlp.up_proj.weight``."""
    return path[: -len(".kernel")] + ".weight" if path.endswith(".kernel") else path


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` dict of a Hugging Face directory, with clear errors."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; pass a Hugging Face model directory or a .gguf file")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{directory} has no config.json; a Hugging Face model directory needs config.json next to its "
            "safetensors files (save one with transformers' save_pretrained)"
        )
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_file} is not valid JSON: {error}") from error


class _SafetensorsReader:
    """Lazy tensor access over one or several safetensors files."""

    def __init__(self, directory: Path):
        index_file = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
        elif single.is_file():
            weight_map = None
        else:
            raise CheckpointError(
                f"{directory} has neither model.safetensors nor model.safetensors.index.json; "
                "export the weights in safetensors format (save_pretrained(..., safe_serialization=True))"
            )
        self._stack = contextlib.ExitStack()
        self._files: dict[str, Any] = {}
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for name in files:
            try:
                self._files[name] = self._stack.enter_context(safe_open(directory / name, framework="numpy"))
            except (SafetensorError, OSError, FileNotFoundError) as error:
                self._stack.close()
                raise CheckpointError(f"cannot read safetensors file {directory / name}: {error}") from error
        if weight_map is None:
            weight_map = {key: "model.safetensors" for key in self._files["model.safetensors"].keys()}
        self.weight_map: dict[str, str] = weight_map

    def names(self) -> set[str]:
        return set(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self.weight_map[name]].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        try:
            return self._files[self.weight_map[name]].get_tensor(name)
        except SafetensorError as error:
            raise CheckpointError(f"cannot read tensor {name} from {self.weight_map[name]}: {error}") from error

    def close(self) -> None:
        self._stack.close()


def load_model(
    path: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    param_dtype: str = "float32",
    dtype: str = "float32",
    remat: bool = False,
    lora_rank: int = 0,
    lora_alpha: float = 16.0,
    lora_targets: tuple[str, ...] = (),
) -> DecoderLM:
    """Loads a policy from a Hugging Face directory or a ``.gguf`` file, placed on ``mesh`` if given.

    ``param_dtype`` is the dtype parameters are stored in, ``dtype`` the compute dtype; ``remat`` turns on
    per-layer rematerialization for training. ``lora_rank > 0`` adds fresh adapters (``lora_b`` zero, so the
    outputs are the checkpoint's) on ``lora_targets`` (:mod:`agentgym_jax.lora`).
    """
    path = Path(path)
    overrides = dict(param_dtype=param_dtype, dtype=dtype, remat=remat, lora_rank=lora_rank, lora_alpha=lora_alpha,
                     lora_targets=tuple(lora_targets))
    if path.is_file() and path.suffix == ".gguf":
        from agentgym_jax import gguf

        checkpoint = gguf.open_gguf(path)
        config = ModelConfig.from_hf(checkpoint.config, **overrides)
        return _build(
            config, set(checkpoint.tensor_names()), checkpoint.tensor_shape, checkpoint.read_tensor, mesh,
            source=str(path),
        )
    hf_config = read_hf_config(path)
    config = ModelConfig.from_hf(hf_config, **overrides)
    reader = _SafetensorsReader(path)
    try:
        return _build(config, reader.names(), reader.shape, reader.get, mesh, source=str(path))
    finally:
        reader.close()


def _build(
    config: ModelConfig,
    available: set[str],
    shape_of: Callable[[str], tuple[int, ...]],
    read: Callable[[str], np.ndarray],
    mesh: Mesh | None,
    source: str,
) -> DecoderLM:
    if mesh is not None:
        sharding.check_model_fits_mesh(config, mesh)
    graphdef, state = nnx.split(abstract_model(config))
    flat = dict(nnx.to_flat_state(state))
    wanted = {".".join(map(str, key)): key for key in flat}
    for path in [p for p in wanted if lora.is_adapter_path(p)]:  # adapters are not in the checkpoint: fresh ones
        key = wanted.pop(path)
        array = lora.initial_adapter(path, tuple(flat[key].shape))
        flat[key].set_value(jax.device_put(array, sharding.param_sharding(mesh, path, array.shape))
                            if mesh is not None else jnp.asarray(array))
    hf_names = {our_to_hf_name(p): p for p in wanted}
    missing = sorted(set(hf_names) - available)
    if missing:
        raise CheckpointError(f"{source} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:5]}")
    unexpected = sorted(
        name for name in available - set(hf_names)
        if not name.endswith(_IGNORED_TENSOR_SUFFIXES)
        and not (config.tie_word_embeddings and name == "lm_head.weight")
    )
    if unexpected:
        raise CheckpointError(
            f"{source} has {len(unexpected)} tensor(s) this architecture does not use, e.g. {unexpected[:5]}; "
            "check that config.json matches the weights"
        )
    param_dtype = to_dtype(config.param_dtype)
    for hf_name, our_path in sorted(hf_names.items()):
        variable = flat[wanted[our_path]]
        expected = tuple(variable.shape)
        stored = shape_of(hf_name)
        transpose = our_path.endswith(".kernel")
        if (stored[::-1] if transpose else stored) != expected:
            want = expected[::-1] if transpose else expected
            raise CheckpointError(f"tensor {hf_name} in {source} has shape {stored}, expected {want}")
        array = read(hf_name)
        if transpose:
            array = array.T
        array = np.asarray(array).astype(param_dtype)
        if mesh is not None:
            placed = jax.device_put(array, sharding.param_sharding(mesh, our_path, expected))
        else:
            placed = jnp.asarray(array)
        del array
        variable.set_value(placed)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def hf_state_items(model: DecoderLM) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(hf_name, numpy tensor in HF layout)`` one parameter at a time (gathered from shards); adapters
    are merged into their kernels."""
    state = nnx.state(model, nnx.Param)
    merged = lora.merged_kernels(model) if model.config.lora_rank else {}
    for key, variable in sorted(nnx.to_flat_state(state), key=lambda kv: ".".join(map(str, kv[0]))):
        path = ".".join(map(str, key))
        if lora.is_adapter_path(path):
            continue
        array = merged[path] if path in merged else np.asarray(jax.device_get(variable[...]))
        yield our_to_hf_name(path), (array.T if path.endswith(".kernel") else array)


def export_model(
    model: DecoderLM,
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    generation_config: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    adapter_only: bool = False,
) -> Path:
    """Writes ``model`` as a Hugging Face directory: config, generation config, safetensors and tokenizer.

    A LoRA policy is written with its adapters merged into the weights, or with ``adapter_only`` as a PEFT
    adapter directory (``adapter_config.json`` naming ``tokenizer_dir`` as the base, ``adapter_model.safetensors``).

    Weights above ``max_shard_bytes`` are split into numbered shards with ``model.safetensors.index.json``.
    Tokenizer files (and the chat template) are copied from ``tokenizer_dir``. The directory is written beside
    ``out_dir`` and renamed into place, so a failure leaves nothing half-written. An existing non-empty
    ``out_dir`` is refused unless it is an earlier export of this tool (it holds ``EXPORT_MARKER``) and
    ``overwrite`` is set; the model directory itself is always refused.
    """
    out = Path(out_dir).absolute()
    _check_export_target(out, tokenizer_dir, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        config = model.config
        if adapter_only:
            base = str(Path(tokenizer_dir).absolute()) if tokenizer_dir else ""
            lora.write_peft_files(model, staging, base_model=base)
        else:
            (staging / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
            _write_generation_config(staging, config, tokenizer_dir, generation_config)
            _write_weights(model, staging, max_shard_bytes)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                source = Path(tokenizer_dir) / name
                if source.is_file():
                    shutil.copyfile(source, staging / name)
        (staging / EXPORT_MARKER).write_text(json.dumps({"written_by": "agentgym_jax"}) + "\n")
        mask = os.umask(0)
        os.umask(mask)
        staging.chmod(0o777 & ~mask)  # mkdtemp makes 0700; give the directory the usual permissions
        if out.exists():  # an earlier export of ours, replaced as a whole
            retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
            out.rename(retired / out.name)
            staging.rename(out)
            shutil.rmtree(retired)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def _check_export_target(out: Path, tokenizer_dir: Any, overwrite: bool) -> None:
    """Refuses an export that would destroy or mix with files this tool did not write."""
    if tokenizer_dir is not None and Path(tokenizer_dir).exists() and out.exists() and \
            out.resolve() == Path(tokenizer_dir).resolve():
        raise CheckpointError(f"export directory {out} is the model directory the policy was loaded from; "
                              "exporting there would destroy the base model. Pass another directory")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export directory {out} is a file; pass a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / EXPORT_MARKER).is_file():
            raise CheckpointError(f"export directory {out} is not empty and was not written by an export of this "
                                  "tool; pass a new or empty directory (nothing was changed)")
        if not overwrite:
            raise CheckpointError(f"export directory {out} holds an earlier export; pass --overwrite to replace it "
                                  "or choose a new directory")


def _write_generation_config(
    out: Path, config: ModelConfig, tokenizer_dir: Any, overrides: Mapping[str, Any] | None
) -> None:
    source = Path(tokenizer_dir) / "generation_config.json" if tokenizer_dir is not None else None
    if source is not None and source.is_file():
        generation = json.loads(source.read_text())
    else:
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.to_hf()["eos_token_id"]}
        if config.pad_token_id is not None:
            generation["pad_token_id"] = config.pad_token_id
    generation.update(overrides or {})
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _write_weights(model: DecoderLM, out: Path, max_shard_bytes: int) -> None:
    for stale in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    total = 0
    temporary: list[Path] = []
    weight_map: dict[str, int] = {}
    # Stream: a shard is flushed to disk as soon as it is full, so at most one shard is held on the host.
    for name, array in hf_state_items(model):
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            temporary.append(_flush(out, shards[-1], len(temporary)))
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(array)
        weight_map[name] = len(shards) - 1
        size += array.nbytes
        total += array.nbytes
    temporary.append(_flush(out, shards[-1], len(temporary)))
    if len(temporary) == 1:
        temporary[0].rename(out / "model.safetensors")
        return
    count = len(temporary)
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for tmp, name in zip(temporary, names):
        tmp.rename(out / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _flush(out: Path, tensors: dict[str, np.ndarray], number: int) -> Path:
    path = out / f".model-part-{number}.safetensors.tmp"
    save_file(tensors, path, metadata={"format": "pt"})
    tensors.clear()
    return path
