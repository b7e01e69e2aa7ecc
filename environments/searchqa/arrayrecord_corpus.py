"""The Deep Search corpus as one ArrayRecord file: random access by row without loading the corpus.

    python -m environments.searchqa.arrayrecord_corpus --generated              # the generated set, in the cache
    python -m environments.searchqa.arrayrecord_corpus --corpus=wiki-18.jsonl   # any wiki-18 JSON-lines file

Each record is one wiki-18 row, ``{"id": ..., "contents": "\\"Title\\"\\ntext"}`` as UTF-8 JSON, written with
``group_size:1`` (one record per chunk, as TFDS writes ArrayRecord) so a read touches one record.
:class:`ArrayRecordCorpus` has :class:`~environments.searchqa.corpus.JsonlCorpus`'s interface (``len``,
``corpus[row] -> Passage``, ``close``) and needs no offsets file: the index is in the file's footer.
The same file opens with ``array_record.python.array_record_data_source.ArrayRecordDataSource``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from environments.searchqa.corpus import CorpusError, Passage, file_fingerprint, iter_corpus, output_marker


def write_json_records(rows: Iterable[dict], path: Path) -> int:
    """Writes each row as one UTF-8 JSON record (``group_size:1``: a read touches one record); returns the count."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    count = 0
    try:
        for row in rows:
            writer.write(json.dumps(row, ensure_ascii=False).encode("utf-8"))
            count += 1
    finally:
        writer.close()
    return count


def open_random_access(path: Path) -> Any:
    """An ``ArrayRecordReader`` for single-record random access: no prefetch and no thread pool (seek + read is ~5 us; threaded
    single reads are ~100x slower)."""
    from array_record.python.array_record_module import ArrayRecordReader

    return ArrayRecordReader(str(path), "readahead_buffer_size:0,max_parallelism:0")


def write_arrayrecord_corpus(passages: Iterable[Passage], path: str | Path) -> int:
    """Writes passages (atomically) as an ArrayRecord corpus; returns how many were written."""
    target = Path(path)
    marker = output_marker(target, "write_arrayrecord_corpus")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.partial")
    count = write_json_records((passage.to_row() for passage in passages), staging)
    marker.write_text(json.dumps({"passages": count}))
    os.replace(staging, target)
    return count


def default_output(corpus_path: str | Path) -> Path:
    """``<cache>/searchqa/arrayrecord/<name>-<fingerprint>.array_record`` (never beside the user's file)."""
    from agentgym_jax.default_model import cache_root

    source = Path(corpus_path)
    return cache_root() / "searchqa" / "arrayrecord" / f"{source.stem}-{file_fingerprint(source)}.array_record"


def convert_corpus(corpus_path: str | Path, out_path: str | Path | None = None) -> Path:
    """Converts a wiki-18 JSON-lines corpus (streamed, constant memory); returns the ArrayRecord file."""
    target = Path(out_path) if out_path else default_output(corpus_path)
    write_arrayrecord_corpus(iter_corpus(corpus_path), target)
    return target


class ArrayRecordCorpus:
    """Random access to the passages of an ArrayRecord corpus (same interface as ``JsonlCorpus``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CorpusError(f"ArrayRecord corpus {self.path} does not exist; convert a wiki-18 JSON-lines file "
                              "with `python -m environments.searchqa.arrayrecord_corpus --corpus=FILE`")
        self._reader = open_random_access(self.path)
        self._length = int(self._reader.num_records())

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, row: int) -> Passage:
        if not 0 <= row < self._length:
            raise IndexError(f"passage row {row} out of range 0..{self._length - 1}")
        self._reader.seek(int(row))
        return self._parse(self._reader.read(), row)

    def get_many(self, rows: Sequence[int]) -> list[Passage]:
        """Several passages in one batched read."""
        for row in rows:
            if not 0 <= row < self._length:
                raise IndexError(f"passage row {row} out of range 0..{self._length - 1}")
        return [self._parse(record, row) for record, row in zip(self._reader.read([int(r) for r in rows]), rows)]

    def _parse(self, record: bytes, row: int) -> Passage:
        try:
            data = json.loads(record)
            return Passage.from_contents(str(data["id"]), data["contents"])
        except (ValueError, KeyError, TypeError) as error:
            raise CorpusError(f"{self.path} record {row}: not a wiki-18 corpus row ({error!r}): {record[:120]!r}") \
                from None

    def close(self) -> None:
        self._reader.close()


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="a wiki-18 JSON-lines corpus file")
    source.add_argument("--generated", action="store_true", help="the generated Deep Search corpus (built if absent)")
    parser.add_argument("--out", default=None, help="default: <cache>/searchqa/arrayrecord/<name>-<fingerprint>...")
    args = parser.parse_args(argv)
    corpus = args.corpus
    if args.generated:
        from environments.searchqa.dataset import prepare_generated

        corpus = prepare_generated() / "corpus.jsonl"
    target = convert_corpus(corpus, args.out)
    reader = ArrayRecordCorpus(target)
    print(f"{target}: {len(reader)} passages, {target.stat().st_size / 2**20:.1f} MiB")
    reader.close()


if __name__ == "__main__":
    main()
