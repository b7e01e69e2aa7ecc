"""Recorded rollouts: every episode of a run as an ArrayRecord dataset, reloadable with one call.

    recorder = RolloutRecorder(workdir / "rollouts")
    recorder.write("train", step, trajectories, trained=train_on)   # -> rollouts-train_000005.array_record-...
    rows = read_rollouts(workdir / "rollouts")                      # list of dicts, in (kind, step) order

One file per (kind, step), each written under a temporary name and renamed into place, so a step that is
played again after a resume replaces its file instead of appending; :meth:`RolloutRecorder.rewind` removes the
files of steps after a restored checkpoint. Records are TFDS-serialized examples of :data:`FEATURES` and the
directory carries TFDS metadata, so ``tfds.builder_from_directory(dir).as_data_source()`` also reads it (one
split per file, e.g. ``train_000005`` or ``eval_after_000150``), without TensorFlow.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from agentgym_jax.rollout import Trajectory

_DATASET = "rollouts"
_SUFFIX = ".array_record-00000-of-00001"
_FILE = re.compile(rf"^{_DATASET}-(?P<kind>[a-z_]+?)_(?P<step>\d{{6}}){re.escape(_SUFFIX)}$")
_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
_KIND = re.compile(r"^[a-z]+(_[a-z]+)*$")


class RolloutRecordError(ValueError):
    """A rollout directory or record that cannot be written or read as asked."""


def features() -> Any:
    """The TFDS features of one recorded episode (texts as UTF-8; ``messages``/``state_keys`` as JSON)."""
    import tensorflow_datasets as tfds

    text, vector = tfds.features.Text(), tfds.features.Tensor
    return tfds.features.FeaturesDict({
        "kind": text, "step": np.int64, "task_id": np.int64, "group_id": np.int64, "episode_id": np.int64,
        "subtask": text, "tokens": vector(shape=(None,), dtype=np.int32),
        "loss_mask": vector(shape=(None,), dtype=np.int8), "logprobs": vector(shape=(None,), dtype=np.float32),
        "turn_ids": vector(shape=(None,), dtype=np.int32), "step_rewards": vector(shape=(None,), dtype=np.float64),
        "messages": text, "state_keys": text, "score": np.float64, "success": np.bool_, "turns": np.int64,
        "end_reason": text, "error": text, "valid_actions": np.int64, "judged_actions": np.int64,
        "trained": np.bool_,
    })


def episode_example(kind: str, step: int, trajectory: Trajectory, trained: bool) -> dict[str, Any]:
    """The feature values of one episode."""
    t = trajectory
    return {
        "kind": kind, "step": step, "task_id": t.task_id, "group_id": t.group_id, "episode_id": t.episode_id,
        "subtask": t.subtask, "tokens": np.asarray(t.tokens, np.int32), "loss_mask": np.asarray(t.loss_mask, np.int8),
        "logprobs": np.asarray(t.logprobs, np.float32), "turn_ids": np.asarray(t.turn_ids, np.int32),
        "step_rewards": np.asarray(t.step_rewards, np.float64),
        "messages": json.dumps(t.messages, ensure_ascii=False), "state_keys": json.dumps(t.state_keys),
        "score": float(t.score), "success": bool(t.success), "turns": t.turns, "end_reason": t.end_reason,
        "error": t.error or "", "valid_actions": t.valid_actions, "judged_actions": t.judged_actions,
        "trained": bool(trained),
    }


def _decode(example: dict[str, Any]) -> dict[str, Any]:
    """A deserialized example as plain Python: str texts, parsed JSON, ints, floats and bools; arrays kept."""
    row: dict[str, Any] = {}
    for key, value in example.items():
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        elif isinstance(value, np.generic):
            value = value.item()
        row[key] = value
    row["messages"] = json.loads(row["messages"])
    row["state_keys"] = json.loads(row["state_keys"])
    row["error"] = row["error"] or None
    return row


class RolloutRecorder:
    """Writes one ArrayRecord file per (kind, step) into ``directory`` and keeps its TFDS metadata current."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._features = features()

    def path(self, kind: str, step: int) -> Path:
        if not _KIND.match(kind):
            raise RolloutRecordError(f"rollout kind {kind!r} must be lower-case words joined by '_', e.g. 'eval_after'")
        return self.directory / f"{_DATASET}-{kind}_{int(step):06d}{_SUFFIX}"

    def write(self, kind: str, step: int, trajectories: Sequence[Trajectory],
              trained: Iterable[Trajectory] | None = None) -> Path:
        """Records ``trajectories`` (``trained``: those the update used; None: all) atomically; returns the file."""
        from array_record.python.array_record_module import ArrayRecordWriter

        used = None if trained is None else {id(t) for t in trained}
        target = self.path(kind, step)
        staging = target.with_name(f".{target.name}.partial")
        writer = ArrayRecordWriter(str(staging), "group_size:1")
        try:
            for trajectory in trajectories:
                example = episode_example(kind, step, trajectory, used is None or id(trajectory) in used)
                writer.write(self._features.serialize_example(example))
        finally:
            writer.close()
        os.replace(staging, target)
        self._write_metadata()
        return target

    def rewind(self, step: int) -> list[Path]:
        """Removes this recorder's files of steps after ``step`` (a restored checkpoint); returns them."""
        removed = [path for path, _, file_step in _record_files(self.directory) if file_step > step]
        for path in removed:
            path.unlink()
        self._write_metadata()
        return removed

    def _write_metadata(self) -> None:
        """``dataset_info.json``/``features.json`` listing every file as a split (TFDS writes them atomically)."""
        import tensorflow_datasets as tfds

        splits = []
        for path, kind, step in _record_files(self.directory):
            splits.append(tfds.core.SplitInfo(name=f"{kind}_{step:06d}", shard_lengths=[_count(path)],
                                              num_bytes=path.stat().st_size))
        tfds.folder_dataset.write_metadata(data_dir=self.directory, features=self._features, split_infos=splits,
                                           filename_template=_TEMPLATE, check_data=False,
                                           description="agentgym-jax recorded rollouts (agentgym_jax.rollout_records)")


def _record_files(directory: Path) -> list[tuple[Path, str, int]]:
    """The record files of ``directory`` as (path, kind, step), ordered by kind then step."""
    found = []
    for path in directory.glob(f"{_DATASET}-*{_SUFFIX}"):
        match = _FILE.match(path.name)
        if match:
            found.append((path, match["kind"], int(match["step"])))
    return sorted(found, key=lambda item: (item[1], item[2]))


def _count(path: Path) -> int:
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(path))
    try:
        return int(reader.num_records())
    finally:
        reader.close()


def read_rollouts(directory: str | Path, kind: str | None = None, steps: Iterable[int] | None = None
                  ) -> list[dict[str, Any]]:
    """Every recorded episode of ``directory`` (optionally one ``kind``, e.g. "train", and some ``steps``), as
    dicts of plain values and numpy arrays, ordered by kind, step and play order."""
    from array_record.python.array_record_module import ArrayRecordReader

    folder = Path(directory)
    if not folder.is_dir():
        raise RolloutRecordError(f"{folder} is not a rollout directory; train with train.record_rollouts=True "
                                 "to write <workdir>/rollouts")
    wanted = None if steps is None else {int(s) for s in steps}
    spec = features()
    rows = []
    for path, file_kind, step in _record_files(folder):
        if (kind is not None and file_kind != kind) or (wanted is not None and step not in wanted):
            continue
        reader = ArrayRecordReader(str(path))
        try:
            records = reader.read_all()
        finally:
            reader.close()
        rows += [_decode(spec.deserialize_example_np(record)) for record in records]
    return rows
