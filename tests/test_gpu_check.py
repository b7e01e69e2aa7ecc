"""The prepared accelerator check runs end to end (on this CPU, with a tiny model of the same family)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_its_whole_path_on_a_tiny_shape(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--shape=tiny", "--batch", "2", f"--out={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["shape"] == "tiny" and result["torch_device"] in ("cpu", "cuda")
    row = result["sampler"][0]
    assert row["batch"] == 2 and row["ours"]["tokens_per_s"] > 0 and row["transformers"]["tokens_per_s"] > 0
    train = result["train_step"]
    assert 0 < train["ours"]["mfu"] and 0 < train["transformers"]["mfu"] and train["ratio_vs_torch"] > 0
