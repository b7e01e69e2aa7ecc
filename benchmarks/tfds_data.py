"""ArrayRecord vs JSON-lines + offsets for the Deep Search corpus: build time, size, and RSS of random reads.

    python -m benchmarks.tfds_data [--passages=1000000] [--reads=1000]

Makes a synthetic corpus of ``--passages`` rows by repeating the generated Deep Search pages with varied ids and
text, writes it as JSON lines and as ArrayRecord, then in a fresh process per format opens the corpus and reads
``--reads`` random passages, reporting that process's RSS before and after and its peak (VmHWM: ru_maxrss would inherit the parent's). Writes
``benchmarks/results/tfds_data.json``. Scratch files go to a temporary directory that is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from benchmarks.common import cpu_facts, write_json
from environments.searchqa.corpus import Passage, iter_corpus

_READER = r"""
import json, random, sys, time
def rss_mib(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
kind, path, offsets, reads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if kind == "arrayrecord":
    from environments.searchqa.arrayrecord_corpus import ArrayRecordCorpus
    before = rss_mib(); t0 = time.perf_counter(); corpus = ArrayRecordCorpus(path)
else:
    from environments.searchqa.corpus import JsonlCorpus
    before = rss_mib(); t0 = time.perf_counter(); corpus = JsonlCorpus(path, offsets)
opened = time.perf_counter()
rows = random.Random(0).sample(range(len(corpus)), reads)
t1 = time.perf_counter(); chars = sum(len(corpus[row].text) for row in rows); t2 = time.perf_counter()
print(json.dumps({"rss_before_open_mib": before, "rss_after_reads_mib": rss_mib(),
                  "peak_rss_mib": rss_mib("VmHWM"),
                  "open_s": opened - t0, "read_s": t2 - t1, "us_per_read": (t2 - t1) / reads * 1e6,
                  "passages": len(corpus), "chars_read": chars}))
"""


def synthetic_passages(source: Path, count: int) -> Iterator[Passage]:
    """``count`` passages: the generated pages over and over, each copy with its own id and a varied sentence."""
    pages = list(iter_corpus(source))
    for i in range(count):
        page = pages[i % len(pages)]
        copy = i // len(pages)
        yield Passage(f"{page.doc_id}#{copy}", page.title if copy == 0 else f"{page.title} ({copy})",
                      page.text if copy == 0 else f"{page.text} Copy {copy} of this page, row {i}.")


def measure_reads(kind: str, path: Path, offsets: Path, reads: int) -> dict[str, float]:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _READER, kind, str(path), str(offsets), str(reads)], cwd=root,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=1_000_000)
    parser.add_argument("--reads", type=int, default=1000)
    args = parser.parse_args()
    from environments.searchqa.arrayrecord_corpus import write_arrayrecord_corpus
    from environments.searchqa.corpus import JsonlCorpus, write_corpus
    from environments.searchqa.dataset import prepare_generated

    source = prepare_generated() / "corpus.jsonl"
    with tempfile.TemporaryDirectory(prefix="tfds_data_bench-") as scratch:
        jsonl, offsets, records = Path(scratch) / "corpus.jsonl", Path(scratch) / "offsets.npy", Path(scratch) / "c.ar"
        t0 = time.perf_counter()
        write_corpus(synthetic_passages(source, args.passages), jsonl)
        t1 = time.perf_counter()
        JsonlCorpus(jsonl, offsets).close()  # computes and stores the line offsets
        t2 = time.perf_counter()
        write_arrayrecord_corpus(synthetic_passages(source, args.passages), records)
        t3 = time.perf_counter()
        result = {
            "passages": args.passages, "random_reads": args.reads, "machine": cpu_facts(),
            "jsonl_offsets": {"build_s": (t1 - t0) + (t2 - t1), "write_jsonl_s": t1 - t0, "offsets_s": t2 - t1,
                              "size_mib": (jsonl.stat().st_size + offsets.stat().st_size) / 2**20,
                              **measure_reads("jsonl", jsonl, offsets, args.reads)},
            "arrayrecord": {"build_s": t3 - t2, "size_mib": records.stat().st_size / 2**20,
                            **measure_reads("arrayrecord", records, offsets, args.reads)},
            "limit_rss_mib": 500,
        }
    result["within_limit"] = all(result[k]["peak_rss_mib"] < 500 for k in ("jsonl_offsets", "arrayrecord"))
    path = write_json("tfds_data", result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
