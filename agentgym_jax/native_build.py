"""Building and loading the native CPU kernels (``agentgym_jax/native/*.cc``, used by
:mod:`agentgym_jax.native_kernels`), and which of them this process may use.

Each source is compiled on first use with the system's C++ compiler (``$CXX``, default ``g++``; ``make setup``
installs it and builds the kernels) into ``<cache>/native`` (``$AGENTGYM_JAX_CACHE``), one file per source,
compiler, jaxlib and CPU (``-march=native``), and registered with XLA. ``AGENTGYM_JAX_NATIVE_KERNELS=0`` keeps
the pure-JAX paths.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from agentgym_jax import sharding
from agentgym_jax.default_model import cache_root
from agentgym_jax.errors import ConfigError

ENV_VAR = "AGENTGYM_JAX_NATIVE_KERNELS"
NATIVE_DIR = Path(__file__).with_name("native")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
SHARED_HEADERS = tuple(NATIVE_DIR / name for name in ("parallel.h", "vector_math.h", "amx.h", "amx_blocks.h",
                                                      "bf16_pairs.h", "prefetch.h",
                                                      "pass_rows.h"))


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel library: its source, extra compiler flags, exported handler symbol and XLA target name."""

    name: str
    symbol: str
    target: str
    flags: tuple[str, ...] = ()

    @property
    def source(self) -> Path:
        return NATIVE_DIR / f"{self.name}.cc"


AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
AMX_READY = Kernel("amx_matmul", "AgentgymAmxReady", "", AMX_FLAGS)  # asks the OS for AMX tiles (not an XLA target)

_registered: set[str] = set()


def enabled() -> bool:
    """Whether programs traced now use the native kernels: on CPU, unless a mesh of several devices is active
    (the kernels do not split across devices) or ``AGENTGYM_JAX_NATIVE_KERNELS=0``."""
    setting = os.environ.get(ENV_VAR, "1").strip()
    if setting not in ("0", "1"):
        raise ConfigError(f"{ENV_VAR}={setting!r}: use 1 (native CPU kernels, the default) or 0 (pure JAX)")
    return setting == "1" and jax.default_backend() == "cpu" and sharding.active_mesh_size() == 1


def _cpu_flags() -> str:
    """The instruction-set flags line of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cpu_signature() -> str:
    """What a ``-march=native`` build depends on: the machine and its instruction-set flags."""
    return platform.machine() + _cpu_flags()


def library_path(kernel: Kernel) -> Path:
    """Where ``kernel``'s built library lives in the cache (it may not exist yet)."""
    import jaxlib

    key = hashlib.sha256()
    for part in (kernel.source.read_bytes(), *(h.read_bytes() for h in SHARED_HEADERS),
                 os.environ.get("CXX", "g++").encode(), " ".join(FLAGS + kernel.flags).encode(),
                 jaxlib.__version__.encode(), _cpu_signature().encode()):
        key.update(part)
    return cache_root() / "native" / f"{kernel.name}-{key.hexdigest()[:16]}.so"


def build(kernel: Kernel) -> Path:
    """Compiles ``kernel``'s library into the cache unless it is there; returns its path. Several processes may
    call this at once: one builds (under a file lock), into a temporary file moved into place."""
    target = library_path(kernel)
    if target.exists():
        return target
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise ConfigError(
            f"the native CPU kernels need a C++ compiler and {compiler!r} was not found: install one "
            f"(`apt-get install g++`; `make setup` does) or point $CXX at it, or set {ENV_VAR}=0 to run the "
            "pure-JAX paths instead")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *FLAGS, *kernel.flags, "-isystem", jax.ffi.include_dir(), str(kernel.source), "-o",
                       str(built)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise ConfigError(
                    f"building the native CPU kernels failed ({' '.join(command)}):\n{result.stderr[-2000:]}\n"
                    f"Fix the compiler set-up, or set {ENV_VAR}=0 to run the pure-JAX paths instead")
            os.replace(built, target)
    return target


@functools.cache
def library(kernel: Kernel) -> ctypes.CDLL:
    return ctypes.cdll.LoadLibrary(str(build(kernel)))


def register(kernel: Kernel) -> None:
    if kernel.target not in _registered:
        handler = getattr(library(kernel), kernel.symbol)
        jax.ffi.register_ffi_target(kernel.target, jax.ffi.pycapsule(handler), platform="cpu")
        _registered.add(kernel.target)


@functools.cache
def amx_available() -> bool:
    """Whether this CPU has AMX bf16 tiles and the OS grants them to this process (builds the kernel if so)."""
    flags = _cpu_flags().split()
    if "amx_bf16" not in flags or "amx_tile" not in flags:
        return False
    return bool(library(AMX_READY).AgentgymAmxReady())


@functools.cache
def avx512_available() -> bool:
    """Whether this CPU has AVX-512F (what :func:`strip_matmul` is written in)."""
    return "avx512f" in _cpu_flags().split()


@functools.cache
def avx512_bf16_available() -> bool:
    """Whether this CPU has AVX512-BF16 dot products (what :func:`bf16_gemm` is written in)."""
    return "avx512_bf16" in _cpu_flags().split()


@functools.cache
def pair_strips_available() -> bool:
    """Whether this CPU has what ``native/pair_strips.cc`` is written in (AVX-512F and AVX-512BW)."""
    flags = _cpu_flags().split()
    return "avx512f" in flags and "avx512bw" in flags


def widened_bf16_available() -> bool:
    """Whether bf16 products on packed strips widen their numbers to fp32 FMAs (``native/pair_strips.cc``): on an
    AVX-512 CPU without AVX512-BF16 dot products (which the AVX512-BF16 and AMX kernels use where present)."""
    return pair_strips_available() and not avx512_bf16_available()
