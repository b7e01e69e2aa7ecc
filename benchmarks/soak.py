"""Soak test (not in CI): a tiny training run under injected faults, with counts of what survived.

    python -m benchmarks.soak                       # about 10 minutes
    python -m benchmarks.soak --minutes=3 --steps=12

Faults, injected at random (seeded) moments:

* env exceptions and NaN rewards, raised inside the environment (``flaky-letters``, registered here);
* env worker kills: ``SIGKILL`` to one of the trainer's env worker processes;
* trainer kills: ``SIGKILL`` to ``launch.train``, then ``--resume``;
* env-server restarts: an HTTP env server killed and restarted under an open client episode.

Counts printed and written to ``benchmarks/results/soak.json``: faults injected and survived per kind, episodes
lost (an episode of a logged step with no trajectory; goal 0), runs mixed (a step logged twice or missing, or a
config other than the run's in ``run.json``; goal 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import psutil

from environments.base import StepResult, register
from tests.synthetic_env import LettersEnvironment

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "soak.json"
TASKS_PER_STEP, SAMPLES = 4, 4


@register("flaky-letters")
class FlakyLetters(LettersEnvironment):
    """``letters`` whose steps sometimes raise or report a NaN reward (deterministic per task and turn)."""

    name = "flaky-letters"

    def __init__(self, raise_rate: float = 0.04, nan_rate: float = 0.02, **kwargs: Any):
        super().__init__(**kwargs)
        self.raise_rate, self.nan_rate = raise_rate, nan_rate
        self._task = 0

    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        self._task = task_id
        return super().reset(task_id)

    def step(self, action_text: str) -> StepResult:
        draw = random.Random(hash((self._task, self._turn, action_text))).random()
        if draw < self.raise_rate:
            raise RuntimeError("injected env fault")
        result = super().step(action_text)
        if draw < self.raise_rate + self.nan_rate:
            return StepResult(result.observation, math.nan, result.done, result.info)
        return result


CONFIG = """
import sys
sys.path.insert(0, {repo!r})
from tests.test_trainer import tiny_config

def get_config():
    c = tiny_config({model!r}, {workdir!r}, steps={steps}, checkpoint_every=1, keep_checkpoints=2, eval_before=False,
                    export_final=False)
    c.env.name = "flaky-letters"
    c.env.import_modules = ("benchmarks.soak",)
    c.env.num_workers = 2
    c.env.step_timeout_s = 30.0
    c.data.update(dict(tasks_per_step={tasks}, samples_per_task={samples}, validation_tasks=0))
    return c
"""


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _worker_pids(trainer: subprocess.Popen) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(trainer.pid).children() if "spawn" in " ".join(p.cmdline())]
    except psutil.Error:
        return []


def train_under_faults(workdir: Path, model: Path, steps: int, deadline: float, rng: random.Random,
                       counts: dict[str, list[int]]) -> None:
    """Runs the tiny config to ``steps`` while killing its env workers and the trainer itself."""
    config = workdir.parent / "soak_config.py"
    config.write_text(CONFIG.format(repo=str(REPO), model=str(model), workdir=str(workdir), steps=steps,
                                    tasks=TASKS_PER_STEP, samples=SAMPLES))
    resume = False
    while time.monotonic() < deadline:
        command = [sys.executable, "-m", "launch.train", f"--config={config}"] + (["--resume"] if resume else [])
        trainer = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        resume = True
        while trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(rng.uniform(4.0, 12.0))  # a restarted trainer needs ~15 s to compile before a step
            if trainer.poll() is not None:
                break
            if rng.random() < 0.75:
                pids = _worker_pids(trainer)
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    counts["worker_kill"][0] += 1
                    counts["worker_kill"][1] += 1  # survived unless the trainer then fails (counted below)
            else:
                os.kill(trainer.pid, signal.SIGKILL)
                trainer.wait()
                counts["trainer_kill"][0] += 1
                break
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
            return
        if trainer.returncode == 0:
            return
        if trainer.returncode != -signal.SIGKILL:
            counts["worker_kill"][1] -= 1
            print(trainer.stderr.read()[-3000:], file=sys.stderr)
            return


def server_restarts(times: int, counts: dict[str, list[int]]) -> None:
    """Restarts an env server under an open client episode; the client must fail loudly, then play on."""
    from environments.agentgym_http import AgentGymHTTPEnv

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "launch.serve_env", "--env=textcraft", f"--port={port}"]

    def start() -> subprocess.Popen:
        server = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return server
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("env server did not start")

    server = start()
    try:
        for _ in range(times):
            client = AgentGymHTTPEnv(base_url=f"http://127.0.0.1:{port}", env_name="textcraft", instruction="x")
            client.reset(0)
            server.kill()
            server.wait()
            server = start()
            counts["server_restart"][0] += 1
            try:
                client.step("Action:\ninventory")
                loud = False  # the old id drove some episode silently
            except Exception:  # noqa: BLE001 - any clear client error is the expected outcome
                loud = True
            fresh = AgentGymHTTPEnv(base_url=f"http://127.0.0.1:{port}", env_name="textcraft", instruction="x")
            fresh.reset(0)
            playable = bool(fresh.step("Action:\ninventory").observation)  # raises if the server cannot play
            counts["server_restart"][1] += int(loud and playable)
    finally:
        server.kill()
        server.wait()


def audit(workdir: Path, steps: int, config_steps: int) -> dict[str, int]:
    """Episodes lost and runs mixed in the finished run directory."""
    rows = _rows(workdir / "metrics.jsonl")
    logged = [row["step"] for row in rows]
    mixed = int(logged != list(range(1, len(logged) + 1)))
    manifest = json.loads((workdir / "run.json").read_text()) if (workdir / "run.json").exists() else {}
    mixed += int(manifest.get("config", {}).get("train", {}).get("steps") != config_steps)
    lost = sum(TASKS_PER_STEP * SAMPLES - round(row.get("rollout/episodes", 0)) for row in rows)
    injected = sum(row.get("rollout/end_env_error", 0) * TASKS_PER_STEP * SAMPLES for row in rows)
    nan_steps = sum(1 for row in rows if not math.isfinite(row.get("rollout/score", 0.0)))
    skipped = sum(row.get("train/skipped_updates", 0.0) for row in rows)
    return {"steps_logged": len(logged), "steps_planned": steps, "episodes_lost": lost, "runs_mixed": mixed,
            "episodes_with_env_errors": round(injected), "steps_with_nan_rewards": nan_steps,
            "updates_skipped_as_non_finite": round(skipped)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--server_restarts", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from tests.tiny_models import save_tiny_chat_model

    rng = random.Random(args.seed)
    counts = {kind: [0, 0] for kind in ("worker_kill", "trainer_kill", "server_restart")}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentgym-soak-") as scratch:
        model = save_tiny_chat_model(Path(scratch) / "model")
        workdir = Path(scratch) / "run"
        train_under_faults(workdir, model, args.steps, started + 60 * args.minutes, rng, counts)
        server_restarts(args.server_restarts, counts)
        audit_counts = audit(workdir, args.steps, args.steps)
    complete = audit_counts["steps_logged"] == args.steps and audit_counts["runs_mixed"] == 0
    counts["trainer_kill"][1] = counts["trainer_kill"][0] if complete else 0  # every kill resumed to a clean run
    result = {
        "faults_injected": {k: v[0] for k, v in counts.items()},
        "faults_survived": {k: v[1] for k, v in counts.items()},
        **audit_counts,
        "minutes": round((time.monotonic() - started) / 60, 2),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
