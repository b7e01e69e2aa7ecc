"""Run observability: every metric to JSONL and TensorBoard, sample trajectories as JSONL (plots: ``plots.py``).

On resume the logs are rewound to the restored step (``MetricLogger.rewind``): JSONL rows of later steps are
dropped and TensorBoard is told to purge them, so a resumed run's logs equal an uninterrupted run's. A torn last
line (a kill in the middle of a write) is dropped with a warning rather than failing the run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from agentgym_jax.run_dir import atomic_write_text

JSONL_LOGS = ("metrics.jsonl", "trajectories.jsonl")


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON rows of ``path``; unreadable lines (e.g. torn by a kill) are skipped with a warning."""
    rows = []
    if not path.exists():
        return rows
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            logging.warning("%s line %d is not valid JSON (a write cut off by a kill?); skipped", path, number)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


class MetricLogger:
    """Writes scalar metrics of each step to ``metrics.jsonl`` and TensorBoard event files in ``directory``."""

    def __init__(self, directory: str | Path, tensorboard: bool = True):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._tensorboard = tensorboard
        self._purge_step: int | None = None
        self._tb: Any = None
        self._open()

    def _open(self) -> None:
        self._jsonl = (self.directory / "metrics.jsonl").open("a")
        self._samples = (self.directory / "trajectories.jsonl").open("a")

    def _board(self) -> Any:
        """The TensorBoard writer, created at the first write (so that a rewind can set its purge step)."""
        if self._tb is None and self._tensorboard:
            from tensorboardX import SummaryWriter

            # A unique suffix: two writers started in the same second would otherwise share (and truncate) a file.
            self._tb = SummaryWriter(str(self.directory / "tensorboard"), purge_step=self._purge_step,
                                     filename_suffix=f".{os.getpid()}.{time.time_ns()}")
        return self._tb

    def rewind(self, step: int) -> None:
        """Drops everything logged for steps after ``step`` (a resume from checkpoint ``step``)."""
        self._jsonl.close()
        self._samples.close()
        for name in JSONL_LOGS:
            path = self.directory / name
            if path.exists():
                kept = [row for row in _read_rows(path) if row["step"] <= step]
                atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in kept))
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._purge_step = step + 1  # TensorBoard hides earlier files' events from this step on
        self._open()

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self._jsonl.flush()
        board = self._board()
        if board is not None:
            for key, value in scalars.items():
                if math.isfinite(value):
                    board.add_scalar(key, value, step)
            board.flush()

    def write_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> None:
        for sample in samples:
            self._samples.write(json.dumps({"step": step, **sample}, ensure_ascii=False) + "\n")
        self._samples.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._samples.close()
        if self._tb is not None:
            self._tb.close()


class NoLogger:
    """A :class:`MetricLogger` that writes nothing: the logger of every process but the first in a
    multi-process run (process 0 logs the metrics, which already cover all processes)."""

    def rewind(self, step: int) -> None:
        del step

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        del step, metrics

    def write_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> None:
        del step, samples

    def close(self) -> None:
        pass


def read_metrics(directory: str | Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``, one per step (the last row per step wins; torn lines are skipped)."""
    rows: dict[int, dict[str, Any]] = {}
    for row in _read_rows(Path(directory) / "metrics.jsonl"):
        rows.setdefault(row["step"], {}).update(row)
    return [rows[s] for s in sorted(rows)]


def plot_run(directory: str | Path) -> Path:
    """Draws the run's learning curves into ``directory/training.png`` (see :mod:`agentgym_jax.plots`)."""
    from agentgym_jax.plots import plot_run as plot_learning_curves  # lazy: plots reads metrics via this module

    return plot_learning_curves(directory)
