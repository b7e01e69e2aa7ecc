"""Fault drill: ``kill -9`` the trainer three times (once while a checkpoint is being written), resume each time,
and compare every logged row with an uninterrupted run: no duplicate, no missing step, equal values."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_trainer import tiny_config
from tests.tiny_models import save_tiny_chat_model

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
# Values that depend on the process or the clock, not on the run's maths.
PROCESS_DEPENDENT = ("time/", "sampler/compilations", "train/update_seconds", "memory/")
CLOCK_RATES = "_per_s"

CONFIG_FILE = """
import sys
sys.path.insert(0, {repo!r})
from tests.test_trainer import tiny_config

def get_config():
    return tiny_config({model!r}, {workdir!r}, steps={steps}, checkpoint_every=1, keep_checkpoints=2,
                       eval_before=False, export_final=False)
"""


def _rows(workdir: Path, name: str = "metrics.jsonl") -> list[dict]:
    path = workdir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _checkpoint_in_progress(workdir: Path) -> bool:
    directory = workdir / "checkpoints"
    try:
        return any(".orbax-checkpoint-tmp" in name for name in os.listdir(directory))
    except FileNotFoundError:
        return False


def _start(config_file: Path, resume: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "launch.train", f"--config={config_file}"] + (["--resume"] if resume else [])
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_when(process: subprocess.Popen, ready, timeout_s: float = 300) -> str:
    """Kills ``process`` with SIGKILL as soon as ``ready()`` holds; returns what happened."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"exited {process.returncode}: {process.stderr.read()[-2000:]}"
        if ready():
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            return "killed"
        time.sleep(0.002)
    process.kill()
    process.wait()
    return "timeout"


def test_three_kills_and_resumes_log_exactly_the_uninterrupted_run(tmp_path):
    from agentgym_jax.trainer import train_and_evaluate

    model = save_tiny_chat_model(tmp_path / "model")
    straight = tmp_path / "straight"
    train_and_evaluate(tiny_config(model, straight, steps=STEPS, checkpoint_every=1, keep_checkpoints=2,
                                   eval_before=False, export_final=False))
    workdir = tmp_path / "drilled"
    config_file = tmp_path / "drill_config.py"
    config_file.write_text(CONFIG_FILE.format(repo=str(REPO), model=str(model), workdir=str(workdir), steps=STEPS))

    rng = random.Random(7)
    first_kill, last_kill = rng.randint(1, 2), rng.randint(5, 6)
    moments = [
        ("after step %d was logged" % first_kill, lambda: len(_rows(workdir)) >= first_kill),
        ("while a checkpoint was being written", lambda: len(_rows(workdir)) >= 3 and _checkpoint_in_progress(workdir)),
        ("after step %d was logged" % last_kill, lambda: len(_rows(workdir)) >= last_kill),
    ]
    for index, (what, ready) in enumerate(moments):
        outcome = _kill_when(_start(config_file, resume=index > 0), ready)
        assert outcome == "killed", f"kill {index + 1} ({what}): {outcome}"
    final = _start(config_file, resume=True)
    _, stderr = final.communicate(timeout=600)
    assert final.returncode == 0, stderr[-3000:]

    expected, got = _rows(straight), _rows(workdir)
    assert [row["step"] for row in got] == list(range(1, STEPS + 1))  # no duplicate, no missing step
    for want, row in zip(expected, got):
        keys = {k for k in want if not k.startswith(PROCESS_DEPENDENT) and not k.endswith(CLOCK_RATES)}
        assert keys == {k for k in row if not k.startswith(PROCESS_DEPENDENT) and not k.endswith(CLOCK_RATES)}
        for key in keys:
            assert row[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (row["step"], key)
    samples = [row["step"] for row in _rows(workdir, "trajectories.jsonl")]
    assert samples == [row["step"] for row in _rows(straight, "trajectories.jsonl")]
    manifest = json.loads((workdir / "run.json").read_text())
    assert len(manifest["resumes"]) == 3
