"""Convert the bundled SmolLM2-135M-Instruct GGUF into a cached Hugging Face directory; print its path.

Usage: python -m launch.prepare_model [--force]
The cache lives under $AGENTGYM_JAX_CACHE (default ~/.cache/agentgym_jax); see agentgym_jax.default_model.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from agentgym_jax.default_model import prepare_default_model
from launch.common import run

_FORCE = flags.DEFINE_bool("force", False, "Convert again even if the directory is already complete.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    print(prepare_default_model(force=_FORCE.value))


if __name__ == "__main__":
    run(main)
