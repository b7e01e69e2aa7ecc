"""Dense retrieval (e5 + FAISS): our Flax BERT against torch's ``BertModel`` on a tiny random model, then index
building and search against brute-force inner products of the torch embeddings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from environments.searchqa.corpus import Passage, write_corpus
from environments.searchqa.dense import DenseEncoder, DenseRetriever, build_dense_index
from environments.searchqa.retrieval import RetrievalError, make_retriever

PASSAGES = [
    Passage("0", "Paris", "paris is the capital of france on the river seine ."),
    Passage("1", "Berlin", "berlin is the capital of germany on the river spree ."),
    Passage("2", "Rome", "rome is the capital of italy on the river tiber ."),
    Passage("3", "Seine", "the seine is a river in france that flows through paris ."),
    Passage("4", "Alps", "the alps are mountains in france italy and germany ."),
    Passage("5", "Danube", "the danube is a long river that flows through vienna and budapest ."),
    Passage("6", "Vienna", "vienna is the capital of austria ."),
    Passage("7", "Tiber", "the tiber flows through rome"),
    Passage("8", "Budapest", "budapest is the capital of hungary on the danube ."),
    Passage("9", "Mountains", "mountains are high ."),
]
QUERIES = ["capital of france", "which river flows through rome ?", "mountains", "danube capital of hungary"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "query", "passage", ":", '"', "?"]


def _words() -> list[str]:
    text = " ".join([p.contents for p in PASSAGES] + QUERIES).lower().replace('"', " ")
    return sorted(set(text.split()) - set(SPECIAL))


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BertModel with a WordPiece tokenizer over the test's words, saved as Hugging Face does."""
    directory = tmp_path_factory.mktemp("e5-tiny")
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + _words()) + "\n")
    transformers.BertTokenizerFast(vocab=str(vocab)).save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=128, initializer_range=0.5)
    model = transformers.BertModel(config).eval()
    with torch.no_grad():  # move LayerNorm scales and biases off 1 and 0 too
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    return directory


def torch_embed(directory: Path, texts: list[str], prefix: str) -> np.ndarray:
    """Search-R1's e5 embedding with transformers: prefix, mean over the attention mask, L2 normalization."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.BertModel.from_pretrained(directory).eval()
    batch = tokenizer([prefix + text for text in texts], max_length=128, truncation=True, padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()


@pytest.fixture(scope="module")
def built(encoder_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    corpus = root / "data" / "corpus.jsonl"
    write_corpus(PASSAGES, corpus)
    index = build_dense_index(corpus, encoder_dir, root / "index" / "e5_Flat.index", batch_size=4)
    return {"corpus": corpus, "index": index, "encoder": encoder_dir}


def test_encode_matches_torch_bert_with_padding_and_truncation(encoder_dir: Path) -> None:
    texts = ["paris", "the river seine flows through paris and france .", "capital of italy ?",
             " ".join(["danube"] * 200)]  # longer than the 128 positions: truncated
    encoder = DenseEncoder(encoder_dir)
    for kind in ("query", "passage"):
        expected = torch_embed(encoder_dir, texts, f"{kind}: ")
        for batch_size in (64, 3):  # one padded batch; several batches of sorted lengths
            ours = encoder.encode(texts, kind, batch_size=batch_size)
            assert ours.dtype == np.float32 and ours.shape == (4, 32)
            np.testing.assert_allclose(ours, expected, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    assert not np.allclose(encoder.encode(texts[:1], "query"), encoder.encode(texts[:1], "passage"), atol=1e-3)
    assert encoder.encode([], "query").shape == (0, 32)
    with pytest.raises(ValueError, match="kind"):
        encoder.encode(["x"], "document")  # type: ignore[arg-type]


def test_bert_prefixed_weights_load_and_bad_directories_are_named(encoder_dir: Path, tmp_path: Path) -> None:
    prefixed = tmp_path / "prefixed"
    shutil.copytree(encoder_dir, prefixed)
    tensors = load_file(prefixed / "model.safetensors")
    pooler = {"bert.pooler.dense.weight": np.zeros((32, 32), np.float32),
              "cls.predictions.bias": np.zeros(128, np.float32)}
    save_file({"bert." + name: array for name, array in tensors.items()} | pooler, prefixed / "model.safetensors")
    np.testing.assert_allclose(DenseEncoder(prefixed).encode(QUERIES, "query"),
                               DenseEncoder(encoder_dir).encode(QUERIES, "query"), atol=1e-6)

    broken = tmp_path / "broken"
    shutil.copytree(encoder_dir, broken)
    save_file({k: v for k, v in tensors.items() if "layer.1.output.dense" not in k}, broken / "model.safetensors")
    with pytest.raises(RetrievalError, match=r"lacks 2 BERT tensor\(s\).*encoder\.layer\.1\.output\.dense\.bias"):
        DenseEncoder(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(RetrievalError, match=r"broken has no model\.safetensors.*intfloat/e5-base-v2"):
        DenseEncoder(broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config | {"model_type": "roberta"}))
    with pytest.raises(RetrievalError, match=r"config\.json is not a BERT encoder.*'roberta'"):
        DenseEncoder(broken)
    (broken / "config.json").unlink()
    with pytest.raises(RetrievalError, match=r"broken has no config\.json.*intfloat/e5-base-v2"):
        DenseEncoder(broken)
    with pytest.raises(RetrievalError, match=r"dense encoder directory .*absent does not exist.*e5-base-v2"):
        DenseEncoder(tmp_path / "absent")


def test_search_equals_brute_force_inner_products(built: dict[str, Path]) -> None:
    passages = torch_embed(built["encoder"], [p.contents for p in PASSAGES], "passage: ")
    scores = torch_embed(built["encoder"], QUERIES, "query: ") @ passages.T
    retriever = DenseRetriever(built["index"], built["corpus"], built["encoder"])
    try:
        results = retriever.search(QUERIES, k=4)
        assert len(results) == len(QUERIES)
        for hits, row in zip(results, scores):
            best = np.argsort(-row)[:4]
            assert np.all(np.diff(row[np.argsort(-row)[:5]]) < -1e-4)  # no near-ties: the order is well defined
            assert [hit.passage for hit in hits] == [PASSAGES[i] for i in best]
            np.testing.assert_allclose([hit.score for hit in hits], row[best], atol=1e-5)
        everything = retriever.search(["mountains"], k=50)[0]
        assert len(everything) == len(PASSAGES)
        assert sorted(hit.passage.doc_id for hit in everything) == [p.doc_id for p in PASSAGES]
        assert all(a.score >= b.score for a, b in zip(everything, everything[1:]))
        assert retriever.search([], k=3) == [] and retriever.search(["paris"], k=0) == [[]]
    finally:
        retriever.close()
    # the corpus directory is the user's: the line offsets went next to the index
    assert sorted(p.name for p in built["corpus"].parent.iterdir()) == ["corpus.jsonl"]
    assert len(list(built["index"].parent.glob("e5_Flat.*.offsets.npy"))) == 1


def test_make_retriever_builds_the_dense_retriever(built: dict[str, Path]) -> None:
    retriever = make_retriever("dense", index_path=str(built["index"]), corpus_path=str(built["corpus"]),
                               encoder_path=str(built["encoder"]))
    try:
        assert isinstance(retriever, DenseRetriever)
        scores = torch_embed(built["encoder"], ["capital of austria"], "query: ") @ torch_embed(
            built["encoder"], [p.contents for p in PASSAGES], "passage: ").T
        [[hit]] = retriever.search(["capital of austria"], k=1)
        assert hit.passage == PASSAGES[int(scores.argmax())]
        assert hit.score == pytest.approx(float(scores.max()), abs=1e-5)
    finally:
        retriever.close()


def test_missing_files_mismatched_corpus_and_foreign_index_files(built: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(RetrievalError, match=r"FAISS index .*nope\.index does not exist.*PeterJinGo/wiki-18-e5-index"):
        DenseRetriever(tmp_path / "nope.index", built["corpus"], built["encoder"])
    with pytest.raises(RetrievalError, match=r"corpus .*nope\.jsonl does not exist.*PeterJinGo/wiki-18-corpus"):
        DenseRetriever(built["index"], tmp_path / "nope.jsonl", built["encoder"])
    with pytest.raises(RetrievalError, match=r"encoder directory .*nope does not exist.*intfloat/e5-base-v2"):
        DenseRetriever(built["index"], built["corpus"], tmp_path / "nope")

    short = tmp_path / "short.jsonl"
    write_corpus(PASSAGES[:9], short)
    with pytest.raises(RetrievalError, match=r"holds 10 vectors but the corpus .*short\.jsonl has 9 passages"):
        DenseRetriever(built["index"], short, built["encoder"], offsets_path=tmp_path / "short.offsets.npy")

    garbage = tmp_path / "garbage.index"
    garbage.write_bytes(b"not an index")
    with pytest.raises(RetrievalError, match=r"garbage\.index is not a FAISS index"):
        DenseRetriever(garbage, built["corpus"], built["encoder"])

    foreign = tmp_path / "foreign.index"
    foreign.write_text("somebody else's file")
    with pytest.raises(RetrievalError, match=r"foreign\.index exists and was not written by build_dense_index"):
        build_dense_index(built["corpus"], built["encoder"], foreign)
    assert foreign.read_text() == "somebody else's file"
    ours = build_dense_index(built["corpus"], built["encoder"], tmp_path / "ours.index")
    assert build_dense_index(built["corpus"], built["encoder"], ours) == ours  # our own index is replaced
    assert not list(tmp_path.glob("*.partial"))
