"""Run observability: every metric to JSONL and TensorBoard, sample trajectories as JSONL (plots: ``plots.py``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping


class MetricLogger:
    """Writes scalar metrics of each step to ``metrics.jsonl`` and TensorBoard event files in ``directory``."""

    def __init__(self, directory: str | Path, tensorboard: bool = True):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.directory / "metrics.jsonl").open("a")
        self._samples = (self.directory / "trajectories.jsonl").open("a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.directory / "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in scalars.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def write_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> None:
        for sample in samples:
            self._samples.write(json.dumps({"step": step, **sample}, ensure_ascii=False) + "\n")
        self._samples.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._samples.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(directory: str | Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` (the last row per step wins, e.g. after a resume)."""
    rows: dict[int, dict[str, Any]] = {}
    path = Path(directory) / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return [rows[s] for s in sorted(rows)]


def plot_run(directory: str | Path) -> Path:
    """Draws the run's learning curves into ``directory/training.png`` (see :mod:`agentgym_jax.plots`)."""
    from agentgym_jax.plots import plot_run as plot_learning_curves  # lazy: plots reads metrics via this module

    return plot_learning_curves(directory)
