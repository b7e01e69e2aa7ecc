"""ArrayRecord vs JSON lines for the Deep Search corpus and questions: build time, size, and RSS of random reads.

    python -m benchmarks.tfds_data [--passages=1000000] [--reads=1000] [--questions=221327] [--parts=corpus,questions]

Questions: ``--questions`` synthetic questions (FlashRAG's original set is 221,327), held in memory as the env's
``QuestionSet`` from JSON lines vs read per question from ``QuestionRecords``; each in a fresh process that builds
the train task list and reads ``--reads`` random questions.

Corpus: a synthetic corpus of ``--passages`` rows made by repeating the generated Deep Search pages with varied
ids and text, written as JSON lines and as ArrayRecord; in a fresh process per format it is opened and ``--reads``
random passages are read, reporting that process's RSS before and after and its peak (VmHWM: ru_maxrss would
inherit the parent's). Writes ``benchmarks/results/tfds_data.json``. Scratch files go to a temporary directory that is removed afterwards.
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

from benchmarks.common import RESULTS_DIR, cpu_facts, write_json
from environments.searchqa.corpus import Passage, iter_corpus

# Shared start of the reader scripts: each runs in a fresh process, so its RSS is its own.
_PRELUDE = r"""
import json, random, sys, time
def rss_mib(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
"""

_READER = _PRELUDE + r"""
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


_QUESTION_READER = _PRELUDE + r"""
kind, path, reads = sys.argv[1], sys.argv[2], int(sys.argv[3])
from environments.searchqa.dataset import QuestionSet, read_questions
from environments.searchqa.question_records import QuestionRecords
before = rss_mib(); t0 = time.perf_counter()
questions = QuestionRecords(path) if kind == "records" else QuestionSet(read_questions(path), path)
train = questions.tasks("train")
opened = time.perf_counter()
ids = [t.task_id for t in random.Random(0).sample(train, reads)]
t1 = time.perf_counter(); chars = sum(len(questions[i].question) for i in ids); t2 = time.perf_counter()
print(json.dumps({"rss_before_open_mib": before, "rss_after_reads_mib": rss_mib(), "peak_rss_mib": rss_mib("VmHWM"),
                  "open_and_task_list_s": opened - t0, "us_per_read": (t2 - t1) / reads * 1e6,
                  "questions": len(questions), "train_tasks": len(train), "chars_read": chars}))
"""


def synthetic_questions(count: int) -> list:
    """``count`` questions: the generated ones over and over, each copy with its own item id (train after test)."""
    import dataclasses

    from environments.searchqa.dataset import prepare_generated, read_questions

    base = read_questions(prepare_generated() / "questions.jsonl")
    return [dataclasses.replace(base[i % len(base)], item_id=i, split="test" if i < count // 4 else "train",
                                question=f"{base[i % len(base)].question} (copy {i // len(base)})")
            for i in range(count)]


def questions_part(count: int, reads: int, scratch: Path) -> dict:
    from environments.searchqa.question_records import write_question_records

    questions = synthetic_questions(count)
    jsonl, records = scratch / "questions.jsonl", scratch / "questions.array_record"
    t0 = time.perf_counter()
    jsonl.write_text("".join(json.dumps(q.to_row()) + "\n" for q in questions))
    t1 = time.perf_counter()
    write_question_records(questions, records)
    t2 = time.perf_counter()
    del questions
    measure = lambda kind, path: run_reader(_QUESTION_READER, kind, path, reads)  # noqa: E731
    index = records.with_name(records.name + ".index.npz")
    return {"questions": count, "random_reads": reads,
            "jsonl_in_memory": {"build_s": t1 - t0, "size_mib": jsonl.stat().st_size / 2**20, **measure("jsonl", jsonl)},
            "records": {"build_s": t2 - t1, "size_mib": (records.stat().st_size + index.stat().st_size) / 2**20,
                        **measure("records", records)}}


def synthetic_passages(source: Path, count: int) -> Iterator[Passage]:
    """``count`` passages: the generated pages over and over, each copy with its own id and a varied sentence."""
    pages = list(iter_corpus(source))
    for i in range(count):
        page = pages[i % len(pages)]
        copy = i // len(pages)
        yield Passage(f"{page.doc_id}#{copy}", page.title if copy == 0 else f"{page.title} ({copy})",
                      page.text if copy == 0 else f"{page.text} Copy {copy} of this page, row {i}.")


def run_reader(script: str, *args: object) -> dict[str, float]:
    """Runs a reader script in a fresh process from the repository root; returns the JSON it prints last."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=root, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_reads(kind: str, path: Path, offsets: Path, reads: int) -> dict[str, float]:
    return run_reader(_READER, kind, path, offsets, reads)


def corpus_part(passages: int, reads: int, scratch: Path) -> dict:
    from environments.searchqa.arrayrecord_corpus import write_arrayrecord_corpus
    from environments.searchqa.corpus import JsonlCorpus, write_corpus
    from environments.searchqa.dataset import prepare_generated

    source = prepare_generated() / "corpus.jsonl"
    jsonl, offsets, records = scratch / "corpus.jsonl", scratch / "offsets.npy", scratch / "c.ar"
    t0 = time.perf_counter()
    write_corpus(synthetic_passages(source, passages), jsonl)
    t1 = time.perf_counter()
    JsonlCorpus(jsonl, offsets).close()  # computes and stores the line offsets
    t2 = time.perf_counter()
    write_arrayrecord_corpus(synthetic_passages(source, passages), records)
    t3 = time.perf_counter()
    result = {
        "passages": passages, "random_reads": reads,
        "jsonl_offsets": {"build_s": (t1 - t0) + (t2 - t1), "write_jsonl_s": t1 - t0, "offsets_s": t2 - t1,
                          "size_mib": (jsonl.stat().st_size + offsets.stat().st_size) / 2**20,
                          **measure_reads("jsonl", jsonl, offsets, reads)},
        "arrayrecord": {"build_s": t3 - t2, "size_mib": records.stat().st_size / 2**20,
                        **measure_reads("arrayrecord", records, offsets, reads)},
        "limit_rss_mib": 500,
    }
    result["within_limit"] = all(result[k]["peak_rss_mib"] < 500 for k in ("jsonl_offsets", "arrayrecord"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=1_000_000)
    parser.add_argument("--reads", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=221_327)
    parser.add_argument("--parts", default="corpus,questions", help="which parts to (re)measure; others are kept")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    previous = RESULTS_DIR / "tfds_data.json"
    result = json.loads(previous.read_text()) if previous.is_file() else {}
    result["machine"] = cpu_facts()
    with tempfile.TemporaryDirectory(prefix="tfds_data_bench-") as scratch:
        if "corpus" in parts:
            result.update(corpus_part(args.passages, args.reads, Path(scratch)))
        if "questions" in parts:
            result["questions_part"] = questions_part(args.questions, args.reads, Path(scratch))
    path = write_json("tfds_data", result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
