"""Shape buckets: pad sizes up to a small fixed set so a whole run compiles a bounded number of programs."""

from __future__ import annotations

from typing import Sequence

from agentgym_jax.errors import ConfigError

# Sequence lengths of trajectory batches, packed learner rows and sampler caches.
LENGTH_BUCKETS = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288,
                  16384)


def bucket(size: int, buckets: Sequence[int], setting: str = "") -> int:
    """The smallest bucket >= ``size``; a clear error when ``size`` exceeds the largest bucket.

    ``setting`` names what the size comes from (e.g. ``"rollout.max_trajectory_tokens"``) for the error.
    """
    for candidate in sorted(buckets):
        if candidate >= size:
            return candidate
    what = f"{setting}={size}" if setting else f"size {size}"
    raise ConfigError(f"{what} exceeds the largest shape bucket, {max(buckets)}; lower it to at most "
                      f"{max(buckets)} (or add a larger bucket to the list it is padded to)")
