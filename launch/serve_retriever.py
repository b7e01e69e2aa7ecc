"""Serves a retriever over Search-R1's ``/retrieve`` protocol (environments/searchqa/retrieval_http.py).

    python -m launch.serve_retriever --port=8000                         # bm25 over the generated corpus
    python -m launch.serve_retriever --index_dir=/data/wiki18-bm25         # bm25 over wiki-18
    python -m launch.serve_retriever --retriever=dense --dense_index=e5_Flat.index \\
        --dense_corpus=wiki-18.jsonl --dense_encoder=/models/e5-base-v2

Search-R1's rollout (``search_url=http://127.0.0.1:8000/retrieve``) and our searchqa env
(``retriever_url=http://127.0.0.1:8000``) can both use it.
"""

from __future__ import annotations

from absl import app, flags

from launch.common import run

RETRIEVER = flags.DEFINE_enum("retriever", "bm25", ["bm25", "dense"], "retrieval engine")
INDEX_DIR = flags.DEFINE_string("index_dir", "", "bm25 index directory (default: the generated set's)")
SEED = flags.DEFINE_integer("seed", 0, "generated set whose index to serve when --index_dir is not given")
DENSE_INDEX = flags.DEFINE_string("dense_index", "", "FAISS index file (the original's e5_Flat.index)")
DENSE_CORPUS = flags.DEFINE_string("dense_corpus", "", "wiki-18 style JSON-lines corpus the FAISS index covers")
DENSE_ENCODER = flags.DEFINE_string("dense_encoder", "", "e5-base-v2 style Hugging Face encoder directory")
HOST = flags.DEFINE_string("host", "127.0.0.1", "interface to bind (0.0.0.0 to serve other machines)")
PORT = flags.DEFINE_integer("port", 8000, "TCP port")


def main(argv: list[str]) -> None:
    del argv
    import jax  # noqa: F401  (imported first: a dense encoder here may use the accelerator; see searchqa/dense.py)
    import uvicorn

    from environments.searchqa.retrieval import make_retriever
    from environments.searchqa.retrieval_http import build_retrieval_app

    if RETRIEVER.value == "bm25":
        index_dir = INDEX_DIR.value
        if not index_dir:
            from environments.searchqa.dataset import prepare_generated

            index_dir = str(prepare_generated(SEED.value) / "bm25")
        retriever = make_retriever("bm25", index_dir=index_dir)
    else:
        missing = [f"--{f.name}" for f in (DENSE_INDEX, DENSE_CORPUS, DENSE_ENCODER) if not f.value]
        if missing:
            raise app.UsageError(f"--retriever=dense needs {', '.join(missing)}")
        retriever = make_retriever("dense", index_path=DENSE_INDEX.value, corpus_path=DENSE_CORPUS.value,
                                   encoder_path=DENSE_ENCODER.value)
    uvicorn.run(build_retrieval_app(retriever, RETRIEVER.value), host=HOST.value, port=PORT.value,
                log_level="warning")


if __name__ == "__main__":
    run(main)
