"""Native CPU kernels: C++ XLA FFI custom calls for the steps XLA's CPU backend runs far from the hardware's limits.

One kernel so far, :func:`decode_attention` (``native/decode_attention.cc``): a decode step's attention over the
KV cache. XLA's lowering of :func:`attention.attend_one_query` copied a bf16 cache out as fp32 for every layer and
step and read every slot of the window; the kernel reads each entry once and only each row's own slots (a decode
step at batch 32 in bf16: 99 -> 82 ms on a 2-core Xeon, ``benchmarks/sampler.py``).

The source is compiled on first use with the system's C++ compiler (``$CXX``, default ``g++``; ``make setup``
installs it and builds the kernel) into ``<cache>/native`` (``$AGENTGYM_JAX_CACHE``), one file per source,
compiler, jaxlib and CPU, and registered with XLA. On other backends, and under a mesh of several devices (the
kernels do not split across devices), the model keeps its pure-JAX path.
``AGENTGYM_JAX_NATIVE_KERNELS=0`` keeps the pure-JAX path on CPU too.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax import sharding
from agentgym_jax.default_model import cache_root
from agentgym_jax.errors import ConfigError

ENV_VAR = "AGENTGYM_JAX_NATIVE_KERNELS"
SOURCE = Path(__file__).with_name("native") / "decode_attention.cc"
TARGET = "agentgym_decode_attention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")

_registered = False


def enabled() -> bool:
    """Whether programs traced now use the native kernels: on CPU, unless a mesh of several devices is active
    (the kernels do not split across devices) or ``AGENTGYM_JAX_NATIVE_KERNELS=0``."""
    setting = os.environ.get(ENV_VAR, "1").strip()
    if setting not in ("0", "1"):
        raise ConfigError(f"{ENV_VAR}={setting!r}: use 1 (native CPU kernels, the default) or 0 (pure JAX)")
    return setting == "1" and jax.default_backend() == "cpu" and sharding.active_mesh_size() == 1


def _cpu_signature() -> str:
    """What a ``-march=native`` build depends on: the machine and its instruction-set flags."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def library_path() -> Path:
    """Where the built kernel library lives in the cache (it may not exist yet)."""
    import jaxlib

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), os.environ.get("CXX", "g++").encode(), " ".join(FLAGS).encode(),
                 jaxlib.__version__.encode(), _cpu_signature().encode()):
        key.update(part)
    return cache_root() / "native" / f"decode_attention-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compiles the kernel library into the cache unless it is there; returns its path. Several processes may
    call this at once: one builds (under a file lock), into a temporary file moved into place."""
    target = library_path()
    if target.exists():
        return target
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise ConfigError(
            f"the native CPU kernels need a C++ compiler and {compiler!r} was not found: install one "
            f"(`apt-get install g++`; `make setup` does) or point $CXX at it, or set {ENV_VAR}=0 to run the "
            "pure-JAX attention instead")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *FLAGS, "-isystem", jax.ffi.include_dir(), str(SOURCE), "-o", str(built)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise ConfigError(
                    f"building the native CPU kernels failed ({' '.join(command)}):\n{result.stderr[-2000:]}\n"
                    f"Fix the compiler set-up, or set {ENV_VAR}=0 to run the pure-JAX attention instead")
            os.replace(built, target)
    return target


def _register() -> None:
    global _registered
    if not _registered:
        library = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.AgentgymDecodeAttention), platform="cpu")
        _registered = True


def decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array, limits: jax.Array, scale: float) -> jax.Array:
    """:func:`attention.attend_one_query` for a stored cache: q [B, 1, K, G, H] over the raw cache entries keys
    [B, K, H, T] and values [B, K, T, H] (fp32, or bf16 held as uint16: :func:`attention.storage_dtype`), row b
    reading slots ``[0, limits[b])`` (clamped to [1, T]); [B, 1, K, G, H] in q's dtype, computed in fp32."""
    if keys.dtype not in (jnp.float32, jnp.uint16) or values.dtype != keys.dtype:
        raise TypeError(f"decode_attention takes fp32 or bf16-bit (uint16) caches, got {keys.dtype}/{values.dtype}")
    _register()
    b, _, k, g, h = q.shape
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((b, k, g, h), jnp.float32))
    out = call(q[:, 0].astype(jnp.float32), keys, values, limits.astype(jnp.int32), scale=np.float32(scale))
    return out[:, None].astype(q.dtype)


if __name__ == "__main__":  # `make setup`: build (or find) the library once
    print(build())
