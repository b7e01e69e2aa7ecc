"""Passages and corpora in the wiki-18 JSON-lines format: ``{"id": "12", "contents": "\\"Title\\"\\ntext"}``.

:class:`JsonlCorpus` reads any passage by row number without loading the file: the byte offset of every
line is computed once and stored as a ``.npy`` array in a directory we own (never beside the user's file),
and both the offsets and the corpus are memory-mapped, so memory use does not grow with the corpus.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from environments.base import EnvError


class CorpusError(EnvError):
    """A corpus file that is missing or not in the wiki-18 JSON-lines format."""


@dataclasses.dataclass(frozen=True)
class Passage:
    """One retrievable passage; ``contents`` is the wiki-18 field (title line, then text)."""

    doc_id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.text}'

    @classmethod
    def from_contents(cls, doc_id: str, contents: str) -> "Passage":
        title, _, text = contents.partition("\n")
        return cls(str(doc_id), title.strip().strip('"'), text)

    def to_row(self) -> dict[str, str]:
        return {"id": self.doc_id, "contents": self.contents}


def write_corpus(passages: Iterable[Passage], path: str | Path) -> int:
    """Writes passages as wiki-18 JSON lines (atomically); returns how many were written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + ".partial")
    count = 0
    with staging.open("w", encoding="utf-8") as out:
        for passage in passages:
            out.write(json.dumps(passage.to_row(), ensure_ascii=False) + "\n")
            count += 1
    os.replace(staging, target)
    return count


def iter_corpus(path: str | Path) -> Iterator[Passage]:
    """Streams the passages of a wiki-18 JSON-lines file, with a clear error on a malformed line."""
    file = Path(path)
    if not file.is_file():
        raise CorpusError(f"corpus file {file} does not exist; give a wiki-18 style JSON-lines file "
                          '(one {"id": ..., "contents": "\\"Title\\"\\ntext"} per line)')
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            yield _parse_line(line, file, number)


def _parse_line(line: str, file: Path, number: int) -> Passage:
    try:
        row = json.loads(line)
        return Passage.from_contents(str(row["id"]), row["contents"])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorpusError(f"{file}:{number}: not a wiki-18 corpus row ({error!r}): {line[:120]!r}") from None


def output_marker(target: Path, tool: str, error: type[EnvError] = CorpusError) -> Path:
    """The marker file beside ``target`` that says ``tool`` wrote it. Raises ``error`` when ``target`` exists
    without one: a file this project did not write is never overwritten."""
    marker = target.with_name(target.name + ".agentgym.json")
    if target.exists() and not marker.is_file():
        raise error(f"{target} exists and was not written by {tool}; delete it or choose another path")
    return marker


def file_fingerprint(path: str | Path) -> str:
    """Identifies a corpus file version by path, size and modification time (cheap, no full read)."""
    stat = Path(path).stat()
    key = f"{Path(path).resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class JsonlCorpus:
    """Random access to the passages of a JSON-lines corpus through memory maps."""

    def __init__(self, path: str | Path, offsets_path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CorpusError(f"corpus file {self.path} does not exist")
        offsets_file = Path(offsets_path)
        if not offsets_file.is_file():
            write_line_offsets(self.path, offsets_file)
        self._offsets = np.load(offsets_file, mmap_mode="r")
        self._file = self.path.open("rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self.path.stat().st_size else None

    def __len__(self) -> int:
        return int(self._offsets.shape[0])

    def __getitem__(self, row: int) -> Passage:
        if not 0 <= row < len(self):
            raise IndexError(f"passage row {row} out of range 0..{len(self) - 1}")
        start = int(self._offsets[row])
        end = int(self._offsets[row + 1]) if row + 1 < len(self) else len(self._map)
        return _parse_line(self._map[start:end].decode("utf-8"), self.path, row + 1)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self._file.close()


def write_line_offsets(corpus_path: Path, offsets_path: Path) -> None:
    """Stores the byte offset of every non-empty line of ``corpus_path`` as a uint64 ``.npy`` file."""
    offsets = array.array("Q")  # 8 bytes per line, not a Python int each
    position = 0
    with corpus_path.open("rb") as lines:
        for line in lines:
            if line.strip():
                offsets.append(position)
            position += len(line)
    offsets_path.parent.mkdir(parents=True, exist_ok=True)
    staging = offsets_path.with_name(offsets_path.stem + ".partial.npy")
    np.save(staging, np.frombuffer(offsets, dtype=np.uint64) if offsets else np.zeros(0, np.uint64))
    os.replace(staging, offsets_path)
