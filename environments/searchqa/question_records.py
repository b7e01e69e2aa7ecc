"""Deep Search questions as one ArrayRecord file: an env worker reads a question when it plays it.

    python -m environments.searchqa.question_records --flashrag_dir=DIR [--datasets=nq,hotpotqa] [--out=FILE]
    python -m environments.searchqa.question_records --generated      # the generated set, for uniformity

Each record is one question (``Question.to_row()``) as UTF-8 JSON, in item-id order, written with
``group_size:1`` so a read touches one record. A sidecar ``<file>.index.npz`` holds every item id, split and
subtask (11 bytes a question), so task lists and item-id lookups never scan the records. Play it with
``env.kwargs=dict(dataset="records", questions_path=FILE)``. The generated set (3,207 questions, 1 MB) stays in
JSON lines by default: at that size the records save nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from environments.base import EnvError, InvalidTaskError, Task, check_split
from environments.searchqa.arrayrecord_corpus import open_random_access, write_json_records
from environments.searchqa.corpus import output_marker
from environments.searchqa.knowledge import Question

SPLIT_CODES = ("train", "test")


class QuestionRecordsError(EnvError):
    """A question-records file that is missing, not ours, or inconsistent with its index."""


def _index_path(path: Path) -> Path:
    return path.with_name(path.name + ".index.npz")


def write_question_records(questions: Iterable[Question], path: str | Path) -> int:
    """Writes questions (sorted by item id, atomically) with their index; returns how many."""
    target = Path(path)
    marker = output_marker(target, "write_question_records", QuestionRecordsError)
    ordered = sorted(questions, key=lambda q: q.item_id)
    ids = np.asarray([q.item_id for q in ordered], np.int64)
    if len(np.unique(ids)) != len(ids):
        raise QuestionRecordsError("item ids are not unique; each question needs its own")
    subtasks = sorted({q.subtask for q in ordered})
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.partial")
    staged_index = staging.with_name(staging.name + ".npz")
    write_json_records((question.to_row() for question in ordered), staging)
    with open(staged_index, "wb") as index:
        np.savez(index, item_ids=ids, splits=np.asarray([SPLIT_CODES.index(check_split(q.split)) for q in ordered],
                                                        np.uint8),
                 subtasks=np.asarray([subtasks.index(q.subtask) for q in ordered], np.uint16),
                 subtask_names=np.asarray(json.dumps(subtasks)))
    marker.write_text(json.dumps({"questions": len(ordered)}))
    os.replace(staged_index, _index_path(target))
    os.replace(staging, target)
    return len(ordered)


class QuestionRecords:
    """Questions by item id from a records file (the interface of ``dataset.QuestionSet``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.source = str(self.path)
        if not self.path.is_file() or not _index_path(self.path).is_file():
            raise QuestionRecordsError(
                f"question records {self.path} (with its .index.npz) do not exist; convert FlashRAG's QA files with "
                "`python -m environments.searchqa.question_records --flashrag_dir=DIR --out=FILE`")
        with np.load(_index_path(self.path)) as index:
            self._ids, self._splits, self._subtasks = index["item_ids"], index["splits"], index["subtasks"]
            self._subtask_names = json.loads(str(index["subtask_names"]))
        self._reader = open_random_access(self.path)
        if int(self._reader.num_records()) != len(self._ids):
            raise QuestionRecordsError(f"{self.path} holds {self._reader.num_records()} records but its index "
                                       f"{len(self._ids)}; convert it again")

    def tasks(self, split: str) -> list[Task]:
        code = SPLIT_CODES.index(check_split(split))
        rows = np.flatnonzero(self._splits == code)
        return [Task(int(self._ids[r]), split, self._subtask_names[int(self._subtasks[r])]) for r in rows]

    def __getitem__(self, item_id: int) -> Question:
        row = int(np.searchsorted(self._ids, item_id)) if isinstance(item_id, int) and not isinstance(
            item_id, bool) else len(self._ids)
        if row >= len(self._ids) or self._ids[row] != item_id:
            raise InvalidTaskError(f"searchqa item id {item_id!r} is not in {self.source} ({len(self._ids)} questions)")
        self._reader.seek(row)
        return Question.from_row(json.loads(self._reader.read()))

    def __len__(self) -> int:
        return len(self._ids)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def default_output(name: str) -> Path:
    """``<cache>/searchqa/questions/<name>.array_record`` (never beside the user's files)."""
    from agentgym_jax.default_model import cache_root

    return cache_root() / "searchqa" / "questions" / f"{name}.array_record"


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--flashrag_dir", help="FlashRAG's QA files: <dir>/<dataset>/<split>.jsonl")
    source.add_argument("--generated", action="store_true", help="the generated Deep Search questions")
    parser.add_argument("--datasets", default="", help="comma-separated FlashRAG datasets (default: the original's)")
    parser.add_argument("--out", default=None, help="default: <cache>/searchqa/questions/<name>.array_record")
    args = parser.parse_args(argv)
    if args.generated:
        from environments.searchqa.dataset import prepare_generated, read_questions

        directory = prepare_generated()
        questions, name = read_questions(directory / "questions.jsonl"), directory.name
    else:
        from environments.searchqa.flashrag import load_flashrag

        chosen = tuple(d for d in args.datasets.split(",") if d)
        questions = load_flashrag(args.flashrag_dir, chosen)
        name = "flashrag-" + ("-".join(chosen) or "all")
    target = Path(args.out) if args.out else default_output(name)
    count = write_question_records(questions, target)
    print(f"{target}: {count} questions, {target.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
