"""Shape buckets: pad sizes up to a small fixed set so a whole run compiles a bounded number of programs."""

from __future__ import annotations

from typing import Sequence

from agentgym_jax.errors import ConfigError


def bucket(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``size``; a clear error when ``size`` exceeds the largest bucket."""
    for candidate in sorted(buckets):
        if candidate >= size:
            return candidate
    raise ConfigError(
        f"size {size} exceeds the largest shape bucket {max(buckets)}; add a larger bucket or lower the "
        "token budget"
    )
