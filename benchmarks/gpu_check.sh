#!/usr/bin/env bash
# The prepared accelerator check (issue: speed). One call on a machine with a GPU and an image holding JAX+CUDA,
# flax, optax, orbax, transformers and torch (no network needed): sampler tokens/s and train-step MFU of a
# Qwen2.5-1.5B-shaped model with random weights, ours against transformers on the same GPU. Writes
# benchmarks/results/gpu.json; sized to finish in under 5 minutes on one H100/H200.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --shape=tiny    # the same path on a CPU in seconds
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
missing=$("$PYTHON" -c "
import importlib.util
names = ['jax', 'flax', 'optax', 'orbax.checkpoint', 'transformers', 'torch', 'ml_collections', 'safetensors']
print(' '.join(n for n in names if importlib.util.find_spec(n.split('.')[0]) is None))" 2>/dev/null || echo "python")
if [ -n "$missing" ]; then
  # GPU images often lack ml-collections: pip install ml-collections==1.1.0 (a pure-Python wheel; no network
  # needed if the wheel is copied over and installed with --no-index)
  echo "error: $PYTHON lacks: $missing (see requirements.txt for the pinned versions)" >&2
  exit 2
fi
"$PYTHON" -c "import jax; print('devices:', jax.devices())"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # leave room for torch on the same GPU
exec "$PYTHON" -m benchmarks.gpu_check "$@"
