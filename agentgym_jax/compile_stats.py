"""Counts XLA compilations per jitted function, from JAX's own monitoring events (not our bookkeeping)."""

from __future__ import annotations

import collections
import threading

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Building a program: tracing to a jaxpr, lowering to an MLIR module, then the backend compile.
_BUILD_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                 _BACKEND_COMPILE_EVENT)
_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()
_seconds: collections.Counter[str] = collections.Counter()
_build_seconds = [0.0]
_installed = False


def _listener(event: str, duration: float, **kwargs: object) -> None:
    if event in _BUILD_EVENTS:
        with _lock:
            _build_seconds[0] += duration
    if event != _BACKEND_COMPILE_EVENT:
        return
    name = str(kwargs.get("fun_name", "?"))
    with _lock:
        _counts[name] += 1
        _seconds[name] += duration


def install() -> None:
    """Starts counting (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_listener)


def compilations(function_name: str) -> int:
    """How many times ``jit(function_name)`` has been compiled in this process since :func:`install`."""
    with _lock:
        return _counts[f"jit({function_name})"]


def compile_seconds(function_name: str) -> float:
    """Total backend compile time of ``jit(function_name)``."""
    with _lock:
        return _seconds[f"jit({function_name})"]


def total_compile_seconds() -> float:
    """Backend compile time of every jitted function so far (since :func:`install`)."""
    with _lock:
        return float(sum(_seconds.values()))


def total_build_seconds() -> float:
    """Seconds spent building programs so far (tracing, lowering and backend compiles, every function)."""
    with _lock:
        return _build_seconds[0]
