"""Retrievers: what a ``<search>`` reaches. One interface, three engines (BM25 here, dense in ``dense.py``,
a Search-R1 server by URL in ``retrieval_http.py``), chosen by name through :func:`make_retriever`.

    retriever = make_retriever("bm25", index_dir=...)
    hits = retriever.search(["capital of France"], k=3)[0]     # list of Hit(passage, score)
    format_information(hits)  # '<information>Doc 1(Title: "France") ...\\n</information>'
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from environments.base import EnvError
from environments.searchqa.corpus import JsonlCorpus, Passage, file_fingerprint, iter_corpus


class RetrievalError(EnvError):
    """The retriever cannot answer (server down, index missing, bad request)."""


@dataclasses.dataclass(frozen=True)
class Hit:
    passage: Passage
    score: float


class Retriever(abc.ABC):
    """Answers batches of queries with the top-k passages of one corpus, best first."""

    @abc.abstractmethod
    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """Top-``k`` hits for every query (fewer when the corpus is smaller than ``k``)."""

    def close(self) -> None:
        """Releases files, memory maps and connections."""


def format_information(hits: Sequence[Hit]) -> str:
    """The original's observation for a search: ``Doc i(Title: <title line>) <text>`` per hit."""
    lines = [f"Doc {i}(Title: {hit.passage.contents.partition(chr(10))[0]}) {hit.passage.text}"
             for i, hit in enumerate(hits, start=1)]
    return "<information>" + "".join(line + "\n" for line in lines) + "</information>"


_RETRIEVERS: dict[str, Callable[..., Retriever]] = {}


def register_retriever(name: str) -> Callable[[Callable[..., Retriever]], Callable[..., Retriever]]:
    """Decorator adding a retriever factory under ``name`` (used by ``make_retriever`` and the env's config)."""

    def decorator(factory: Callable[..., Retriever]) -> Callable[..., Retriever]:
        _RETRIEVERS[name] = factory
        return factory

    return decorator


def make_retriever(name: str, **kwargs: Any) -> Retriever:
    """Builds a registered retriever: ``"bm25"``, ``"dense"`` or ``"http"``."""
    if name == "dense":
        import environments.searchqa.dense  # noqa: F401  (registers "dense"; needs faiss)
    if name == "http":
        import environments.searchqa.retrieval_http  # noqa: F401
    if name not in _RETRIEVERS:
        raise RetrievalError(f"unknown retriever {name!r}; registered: {', '.join(sorted(_RETRIEVERS))}")
    return _RETRIEVERS[name](**kwargs)


# ----------------------------------------------------------------------------------------------- BM25 (bm25s)

_BM25_MANIFEST = "agentgym_bm25.json"
_OFFSETS = "corpus_offsets.npy"


def _tokenize(texts: Sequence[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=False)


def build_bm25_index(corpus_path: str | Path, index_dir: str | Path) -> Path:
    """Indexes a wiki-18 JSON-lines corpus with bm25s into ``index_dir`` (a directory this creates).

    The title line is indexed with the text. The directory records which corpus file it indexes, so a
    changed corpus is noticed at load time.
    """
    import bm25s

    corpus_file, target = Path(corpus_path), Path(index_dir)
    if target.exists() and not (target / _BM25_MANIFEST).is_file():
        raise RetrievalError(f"{target} exists and is not a bm25 index of ours; choose an empty or new directory")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    texts = [f"{p.title} {p.text}" for p in iter_corpus(corpus_file)]
    model = bm25s.BM25()
    model.index(_tokenize(texts), show_progress=False)
    del texts
    model.save(str(staging), show_progress=False)
    JsonlCorpus(corpus_file, staging / _OFFSETS).close()
    manifest = {"corpus": str(corpus_file.resolve()), "fingerprint": file_fingerprint(corpus_file),
                "passages": int(np.load(staging / _OFFSETS, mmap_mode="r").shape[0])}
    (staging / _BM25_MANIFEST).write_text(json.dumps(manifest, indent=1))
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    return target


@register_retriever("bm25")
class BM25Retriever(Retriever):
    """bm25s over a wiki-18 corpus; the index and corpus are memory-mapped, not loaded."""

    def __init__(self, index_dir: str | Path, threads: int = 0) -> None:
        import bm25s

        self.index_dir = Path(index_dir)
        manifest_file = self.index_dir / _BM25_MANIFEST
        if not manifest_file.is_file():
            raise RetrievalError(f"{self.index_dir} is not a bm25 index; build one with "
                                 "`python -m environments.searchqa.build --corpus=FILE` (or `make setup`)")
        manifest = json.loads(manifest_file.read_text())
        corpus_file = Path(manifest["corpus"])
        if not corpus_file.is_file() or file_fingerprint(corpus_file) != manifest["fingerprint"]:
            raise RetrievalError(f"the corpus {corpus_file} indexed in {self.index_dir} is missing or has changed "
                                 "since indexing; rebuild the index")
        self._model = bm25s.BM25.load(str(self.index_dir), mmap=True, show_progress=False)
        self.corpus = JsonlCorpus(corpus_file, self.index_dir / _OFFSETS)
        self._threads = threads

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        if not queries:
            return []
        k = min(int(k), len(self.corpus))
        tokens = _tokenize(queries)
        results: list[list[Hit]] = [[] for _ in queries]
        known = [i for i, query in enumerate(tokens) if any(t in self._model.vocab_dict for t in query)]
        if not known:
            return results
        rows, scores = self._model.retrieve([[t for t in tokens[i] if t in self._model.vocab_dict] for i in known],
                                            k=k, show_progress=False, n_threads=self._threads)
        for position, query_index in enumerate(known):
            results[query_index] = [Hit(self.corpus[int(row)], float(score))
                                    for row, score in zip(rows[position], scores[position]) if score > 0]
        return results

    def close(self) -> None:
        self.corpus.close()
