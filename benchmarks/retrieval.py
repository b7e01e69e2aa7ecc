"""Retrieval on the generated Deep Search set: recall@k of the gold passages, speed, build time and memory.

    python -m benchmarks.retrieval            # writes benchmarks/results/retrieval.json

Recall@k counts a hop as found when any passage stating that hop's fact is in the top k. It is measured
with two queries: the question text itself (what a first search usually is) and the hop's gold query (the
entity and the attribute, e.g. "France currency", which a good agent writes for the second hop, whose
entity the question does not name). Queries/s: one query per call in-process, batches of 32 in-process,
and one query per call over HTTP (our Search-R1 /retrieve server in a subprocess, our client).
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import free_port, median, peak_rss_mib, write_json
from environments.searchqa.corpus import write_corpus
from environments.searchqa.knowledge import KINDS, generate
from environments.searchqa.retrieval import build_bm25_index, make_retriever

REPO = Path(__file__).resolve().parents[1]


def recall(retriever, questions, k: int) -> dict[str, dict[str, float]]:
    found = collections.defaultdict(list)
    for kind in KINDS:
        chosen = [q for q in questions if q.subtask == kind]
        by_question = retriever.search([q.question for q in chosen], k)
        by_gold = [retriever.search(list(q.gold_queries), k) for q in chosen]
        for q, hits, gold_hits in zip(chosen, by_question, by_gold):
            ids = {h.passage.doc_id for h in hits}
            for hop, gold in enumerate(q.gold_doc_ids):
                found[f"{kind}/hop{hop + 1}/question"].append(bool(ids & set(gold)))
                found[f"{kind}/hop{hop + 1}/gold_query"].append(bool({h.passage.doc_id for h in gold_hits[hop]}
                                                                     & set(gold)))
    return {key: {"recall": round(sum(v) / len(v), 4), "n": len(v)} for key, v in sorted(found.items())}


def queries_per_second(search, queries, batch: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(queries), batch):
            search(queries[i:i + batch])
        rates.append(len(queries) / (time.perf_counter() - start))
    return round(median(rates), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--speed_queries", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        start = time.perf_counter()
        passages, questions = generate(0)
        generate_s = time.perf_counter() - start
        write_corpus(passages, root / "corpus.jsonl")
        rss_before_index = peak_rss_mib()
        start = time.perf_counter()
        build_bm25_index(root / "corpus.jsonl", root / "bm25")
        build_s = time.perf_counter() - start
        index_mb = sum(f.stat().st_size for f in (root / "bm25").iterdir()) / 2**20
        retriever = make_retriever("bm25", index_dir=root / "bm25")
        results = recall(retriever, questions, args.k)
        queries = [q.question for q in questions][: args.speed_queries]
        single = queries_per_second(lambda batch: retriever.search(batch, args.k), queries, 1, args.repeats)
        batched = queries_per_second(lambda batch: retriever.search(batch, args.k), queries, 32, args.repeats)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "launch.serve_retriever", f"--port={port}",
                                   f"--index_dir={root / 'bm25'}"], cwd=REPO)
        try:
            client = make_retriever("http", url=f"http://127.0.0.1:{port}", retries=0)
            deadline = time.time() + 60
            while True:
                try:
                    client.search(["warm up"], args.k)
                    break
                except Exception:  # noqa: BLE001 - the server is still starting
                    if time.time() > deadline or server.poll() is not None:
                        raise
                    time.sleep(0.5)
            http = queries_per_second(lambda batch: client.search(batch, args.k), queries, 1, args.repeats)
        finally:
            server.terminate()
            server.wait(timeout=30)
        retriever.close()
    payload = {
        "what": "bm25s over the generated geography corpus; recall@k of gold passages per kind and hop",
        "k": args.k, "passages": len(passages), "questions": len(questions),
        "corpus_mb": round(sum(len(p.contents.encode()) for p in passages) / 2**20, 2),
        "generate_s": round(generate_s, 2), "index_build_s": round(build_s, 2), "index_mb": round(index_mb, 2),
        "recall": results,
        "queries_per_s": {"in_process_single": single, "in_process_batch32": batched, "http_single": http},
        "peak_rss_mb": round(peak_rss_mib(), 1), "rss_before_index_mb": round(rss_before_index, 1),
    }
    path = write_json("retrieval", payload)
    print(f"wrote {path}")
    for key, value in results.items():
        print(f"{key:36s} {value['recall']:.3f} (n={value['n']})")
    print(payload["queries_per_s"], f"build {build_s:.1f}s index {index_mb:.1f} MB peak RSS {payload['peak_rss_mb']} MB")


if __name__ == "__main__":
    main()
