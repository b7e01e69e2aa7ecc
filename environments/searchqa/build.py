"""Builds what the searchqa env reads: the generated set, or a bm25 index over your own corpus.

    python -m environments.searchqa.build                                 # the generated set (make setup runs it)
    python -m environments.searchqa.build --seed=1 --force                # another seed, or rebuild
    python -m environments.searchqa.build --corpus=wiki-18.jsonl --out=/data/wiki18-bm25

An index over your corpus is then used with ``--config.env.kwargs.index_dir=/data/wiki18-bm25`` or served with
``python -m launch.serve_retriever --index_dir=/data/wiki18-bm25``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from environments.base import EnvError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="generated set's seed")
    parser.add_argument("--force", action="store_true", help="rebuild the generated set even if it exists")
    parser.add_argument("--corpus", default="", help="a wiki-18 style JSON-lines corpus to index instead")
    parser.add_argument("--out", default="", help="new directory for the corpus's bm25 index")
    args = parser.parse_args(argv)
    from environments.searchqa.dataset import prepare_generated
    from environments.searchqa.retrieval import build_bm25_index

    start = time.perf_counter()
    try:
        if args.corpus:
            if not args.out:
                parser.error("--corpus needs --out=<new directory for the index>")
            print(f"indexed {args.corpus} into {build_bm25_index(args.corpus, args.out)} "
                  f"in {time.perf_counter() - start:.1f} s")
        else:
            directory = prepare_generated(args.seed, force=args.force)
            print(f"generated set in {directory}: {json.loads((directory / 'manifest.json').read_text())}")
    except EnvError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
