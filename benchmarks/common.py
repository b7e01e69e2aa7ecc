"""Helpers shared by the benchmarks: wall-clock timing, medians, peak RSS, memory bandwidth, machine facts."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (a clear error for an empty one)."""
    if not values:
        raise ValueError("median of no measurements: run the measured function at least once")
    return float(statistics.median(values))


def time_once(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds one call of ``fn`` takes, and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def time_repeats(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return [time_once(fn)[0] for _ in range(repeats)]


@contextlib.contextmanager
def without_native_kernels() -> Iterator[None]:
    """Programs traced inside run the pure-JAX paths (``AGENTGYM_JAX_NATIVE_KERNELS=0``); the previous setting is
    restored after."""
    from agentgym_jax import native_kernels

    previous = os.environ.get(native_kernels.ENV_VAR)
    os.environ[native_kernels.ENV_VAR] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(native_kernels.ENV_VAR)
        else:
            os.environ[native_kernels.ENV_VAR] = previous


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def memory_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Sustained copy bandwidth in GB/s (bytes read + bytes written per second), median of ``repeats``.

    Copies a buffer far larger than the caches with ``np.copyto``; each copy reads and writes ``megabytes``.
    """
    n = megabytes * 1024 * 1024 // 8
    source = np.ones(n, np.float64)
    target = np.empty_like(source)
    np.copyto(target, source)  # touch every page before timing
    seconds = time_repeats(lambda: np.copyto(target, source), repeats)
    return 2 * source.nbytes / median(seconds) / 1e9


def matmul_flops_per_s(dtype: str, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large jitted square JAX matmul in ``dtype`` with fp32 accumulation (as our layers ask for it):
    the practical compute peak of this machine for that dtype."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (size, size), jnp.float32).astype(dtype)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    matmul(a, b).block_until_ready()
    seconds = time_repeats(lambda: matmul(a, b).block_until_ready(), repeats)
    return 2.0 * size**3 / median(seconds)


def cpu_facts() -> dict[str, Any]:
    """CPU model, core count and the vector/matrix ISA flags relevant to fp32 and bf16 kernels."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
    return {
        "model": model,
        "cpus": os.cpu_count(),
        "isa": {flag: flag in flags for flag in wanted},
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Writes ``payload`` to ``benchmarks/results/<name>.json`` (indented, keys in insertion order)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for servers the benchmarks start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
