"""JAX's persistent compilation cache for the launchers: a program compiled by one run is loaded by the next.

A training run compiles a few dozen programs (every decoder layer unrolled; the CPU demo spends 20-34 s of each
of its first steps compiling). With the cache, a second run with the same model and settings reads them from
disk instead. The cache lives in ``<cache_root>/xla`` (``~/.cache/agentgym_jax/xla``, or under
``$AGENTGYM_JAX_CACHE``) and holds only files JAX writes there; it is capped at ``max_bytes``, JAX evicting the
least recently used entries. Keys cover the program, the JAX/XLA versions, the backend and its flags, so a
changed model or setting compiles afresh.
"""

from __future__ import annotations

from pathlib import Path

import jax

from agentgym_jax.default_model import cache_root
from agentgym_jax.errors import ConfigError

DEFAULT_MAX_BYTES = 4 << 30
MIN_COMPILE_SECONDS = 0.5  # programs that compile faster are cheaper to recompile than to read back


def default_directory() -> Path:
    return cache_root() / "xla"


def enable(directory: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
           min_compile_seconds: float = MIN_COMPILE_SECONDS) -> Path:
    """Points JAX's persistent compilation cache at ``directory`` (default :func:`default_directory`); programs
    that compiled in under ``min_compile_seconds`` are not stored."""
    path = Path(directory).expanduser() if directory else default_directory()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot keep compiled programs in {path} ({error.strerror}); pass "
                          "--compilation_cache_dir=<a writable folder>, or =off") from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
    return path
