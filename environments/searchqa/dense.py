"""Dense retrieval as in Search-R1: e5-base-v2 embeddings (a BERT encoder in Flax NNX, mean-pooled, L2-normalized)
in a FAISS Flat inner-product index whose row ``i`` is passage ``i`` of a wiki-18 corpus.

    build_dense_index("wiki-18.jsonl", "e5-base-v2/", "e5_Flat.index")   # or download the original's index
    retriever = make_retriever("dense", index_path="e5_Flat.index", corpus_path="wiki-18.jsonl",
                               encoder_path="e5-base-v2/")
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any, Literal, Sequence

if "jax" not in sys.modules:  # an env worker process: encode on its CPU, never claim the trainer's accelerator
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from environments.searchqa.corpus import JsonlCorpus, file_fingerprint, iter_corpus, output_marker  # noqa: E402
from environments.searchqa.retrieval import Hit, RetrievalError, Retriever, register_retriever  # noqa: E402

INDEX_SOURCE = "the original's FAISS Flat index (e5_Flat.index in PeterJinGo/wiki-18-e5-index) or build_dense_index"
CORPUS_SOURCE = "the wiki-18 corpus (wiki-18.jsonl in PeterJinGo/wiki-18-corpus) the index was built from"
ENCODER_SOURCE = "a Hugging Face download of intfloat/e5-base-v2 (config.json, model.safetensors, tokenizer)"
MAX_LENGTH = {"query": 256, "passage": 512}  # Search-R1's query length; FlashRAG's when indexing passages
PREFIX = {"query": "query: ", "passage": "passage: "}  # the e5 convention
Kind = Literal["query", "passage"]


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face BERT ``config.json`` the encoder uses."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def read(cls, directory: Path) -> "BertConfig":
        file = directory / "config.json"
        if not file.is_file():
            raise RetrievalError(f"{directory} has no config.json; the dense encoder is {ENCODER_SOURCE}")
        raw = json.loads(file.read_text())
        if (raw.get("model_type") != "bert" or raw.get("hidden_act", "gelu") != "gelu"
                or raw.get("position_embedding_type", "absolute") != "absolute"):
            raise RetrievalError(f"{file} is not a BERT encoder with absolute positions and gelu (model_type="
                                 f"{raw.get('model_type')!r}); the dense encoder is {ENCODER_SOURCE}")
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw})


def _layer_norm(config: BertConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps, use_fast_variance=False, rngs=rngs)


class Embeddings(nnx.Module):
    """Word + absolute position + token type 0 embeddings, then LayerNorm."""

    def __init__(self, config: BertConfig, rngs: nnx.Rngs) -> None:
        self.word_embeddings = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        self.position_embeddings = nnx.Embed(config.max_position_embeddings, config.hidden_size, rngs=rngs)
        self.token_type_embeddings = nnx.Embed(config.type_vocab_size, config.hidden_size, rngs=rngs)
        self.norm = _layer_norm(config, rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        positions = self.position_embeddings.embedding[...][: ids.shape[1]]
        return self.norm(self.word_embeddings(ids) + positions + self.token_type_embeddings.embedding[...][0])


class SelfAttention(nnx.Module):
    """Multi-head self-attention, residual, post-LayerNorm (HF ``BertAttention``)."""

    def __init__(self, config: BertConfig, rngs: nnx.Rngs) -> None:
        size, self.heads = config.hidden_size, config.num_attention_heads
        self.query, self.key, self.value, self.output = (nnx.Linear(size, size, rngs=rngs) for _ in range(4))
        self.norm = _layer_norm(config, rngs)

    def __call__(self, x: jax.Array, mask_bias: jax.Array) -> jax.Array:
        q, k, v = (f(x).reshape(*x.shape[:2], self.heads, -1) for f in (self.query, self.key, self.value))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]) + mask_bias
        context = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(x.shape)
        return self.norm(x + self.output(context))


class Layer(nnx.Module):
    """Self-attention, then dense, exact (erf) GELU, dense, residual, post-LayerNorm (HF ``BertLayer``)."""

    def __init__(self, config: BertConfig, rngs: nnx.Rngs) -> None:
        self.attention = SelfAttention(config, rngs)
        self.intermediate = nnx.Linear(config.hidden_size, config.intermediate_size, rngs=rngs)
        self.output = nnx.Linear(config.intermediate_size, config.hidden_size, rngs=rngs)
        self.norm = _layer_norm(config, rngs)

    def __call__(self, x: jax.Array, mask_bias: jax.Array) -> jax.Array:
        x = self.attention(x, mask_bias)
        return self.norm(x + self.output(jax.nn.gelu(self.intermediate(x), approximate=False)))


# Hugging Face's module names where ours differ (the layers' inside ``encoder.layer.N``), and parameter names.
_HF_MODULES = {("embeddings", "norm"): "embeddings.LayerNorm", ("attention", "output"): "attention.output.dense",
               ("attention", "norm"): "attention.output.LayerNorm", ("intermediate",): "intermediate.dense",
               ("output",): "output.dense", ("norm",): "output.LayerNorm",
               **{("attention", name): f"attention.self.{name}" for name in ("query", "key", "value")}}
_HF_LEAVES = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}


def hf_name(path: Sequence[Any]) -> str:
    """``("layers", 0, "attention", "query", "kernel")`` -> ``encoder.layer.0.attention.self.query.weight``."""
    *modules, leaf = map(str, path)
    prefix = f"encoder.layer.{modules[1]}." if modules[0] == "layers" else ""
    modules = modules[2:] if prefix else modules
    return prefix + _HF_MODULES.get(tuple(modules), ".".join(modules)) + "." + _HF_LEAVES[leaf]


class BertEncoder(nnx.Module):
    """HF ``BertModel`` without its pooler: token ids and attention mask -> last hidden states [b, t, hidden]."""

    def __init__(self, config: BertConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embeddings = Embeddings(config, rngs)
        self.layers = nnx.List([Layer(config, rngs) for _ in range(config.num_hidden_layers)])

    def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        mask_bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x, mask_bias)
        return x

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "BertEncoder":
        """Loads ``config.json`` and ``model.safetensors`` (names with or without ``bert.``; the pooler is unused)."""
        from safetensors.numpy import load_file

        directory = Path(path)
        config = BertConfig.read(directory)
        weights_file = directory / "model.safetensors"
        if not weights_file.is_file():
            raise RetrievalError(f"{directory} has no model.safetensors; the dense encoder is {ENCODER_SOURCE}")
        tensors = {name.removeprefix("bert."): array for name, array in load_file(weights_file).items()}
        graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(config, nnx.Rngs(0))))
        flat = dict(nnx.to_flat_state(state))
        missing = sorted(hf_name(key) for key in flat if hf_name(key) not in tensors)
        if missing:
            raise RetrievalError(f"{weights_file} lacks {len(missing)} BERT tensor(s), e.g. {missing[:4]}")
        for key, variable in flat.items():
            array = tensors[hf_name(key)]
            array = array.T if key[-1] == "kernel" else array
            if array.shape != tuple(variable.shape):
                raise RetrievalError(f"tensor {hf_name(key)} in {weights_file} has shape {array.shape}, "
                                     f"config.json implies {tuple(variable.shape)}")
            variable.set_value(jnp.asarray(array, jnp.float32))
        return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _embed(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of the hidden states over the attention mask, L2-normalized (Search-R1's e5 pooling)."""
    hidden = nnx.merge(graphdef, state)(ids, mask)
    weights = mask[..., None].astype(hidden.dtype)
    pooled = (hidden * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1.0)
    return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def _bucket(n: int, minimum: int) -> int:
    """The next power of two from ``minimum`` up: few distinct shapes, so jit compiles a handful of times."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


class DenseEncoder:
    """Texts -> unit-length e5 embeddings: the directory's tokenizer, then :class:`BertEncoder` under ``jax.jit``."""

    def __init__(self, path: str | os.PathLike) -> None:
        from transformers import AutoTokenizer

        self.path = _require(path, "dense encoder directory", ENCODER_SOURCE)
        self.model = BertEncoder.from_pretrained(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.dim = self.model.config.hidden_size
        graphdef, self._state = nnx.split(self.model)
        self._embed = jax.jit(functools.partial(_embed, graphdef))

    def encode(self, texts: Sequence[str], kind: Kind, batch_size: int = 64) -> np.ndarray:
        """float32 [len(texts), hidden]; texts get the e5 prefix of ``kind`` and are truncated to its length."""
        if kind not in PREFIX:
            raise ValueError(f"kind must be 'query' or 'passage', not {kind!r}")
        max_length = min(MAX_LENGTH[kind], self.model.config.max_position_embeddings)
        order = np.argsort([len(text) for text in texts], kind="stable")  # similar lengths share a batch
        out = np.zeros((len(texts), self.dim), np.float32)
        for start in range(0, len(texts), batch_size):
            rows = order[start:start + batch_size]
            tokens = self.tokenizer([PREFIX[kind] + texts[i] for i in rows], max_length=max_length,
                                    truncation=True, padding=True, return_tensors="np")
            count, length = tokens["input_ids"].shape
            shape = (_bucket(count, 1), min(_bucket(length, 16), max_length))
            ids, mask = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
            ids[:count, :length], mask[:count, :length] = tokens["input_ids"], tokens["attention_mask"]
            out[rows] = np.asarray(self._embed(self._state, ids, mask))[:count]
        return out


def _require(path: str | os.PathLike, what: str, source: str) -> Path:
    file = Path(path)
    if not file.exists():
        raise RetrievalError(f"{what} {file} does not exist; it is {source}")
    return file


def build_dense_index(corpus_path: str | os.PathLike, encoder_path: str | os.PathLike,
                      index_path: str | os.PathLike, batch_size: int = 128) -> Path:
    """Embeds every passage's ``contents`` (``"Title"\\ntext``, as Search-R1 indexes them) into a FAISS
    ``IndexFlatIP`` written atomically to ``index_path``; only an index this function wrote is replaced."""
    import faiss

    corpus_file, target = _require(corpus_path, "corpus", CORPUS_SOURCE), Path(index_path)
    manifest = output_marker(target, "build_dense_index", RetrievalError)
    encoder = DenseEncoder(encoder_path)
    index = faiss.IndexFlatIP(encoder.dim)
    passages = iter_corpus(corpus_file)
    while chunk := [passage.contents for passage in itertools.islice(passages, batch_size * 32)]:
        index.add(encoder.encode(chunk, "passage", batch_size))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + ".partial")
    faiss.write_index(index, str(staging))
    manifest.write_text(json.dumps({"corpus": str(corpus_file.resolve()), "passages": index.ntotal,
                                    "encoder": str(Path(encoder_path).resolve())}, indent=1))
    os.replace(staging, target)
    return target


def read_index(index_file: Path) -> Any:
    """Reads a FAISS index memory-mapped (flat codes via ``IO_FLAG_MMAP_IFC``, inverted lists via ``IO_FLAG_MMAP``),
    so the 60 GiB wiki-18 index is paged in on demand. Types faiss cannot map that way (such as an in-memory
    IVF index) are read into memory instead."""
    import faiss

    try:
        return faiss.read_index(str(index_file), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_MMAP_IFC)
    except RuntimeError:
        try:
            return faiss.read_index(str(index_file))
        except RuntimeError as error:
            raise RetrievalError(f"{index_file} is not a FAISS index ({str(error).splitlines()[0]}); "
                                 f"it should be {INDEX_SOURCE}") from None


@register_retriever("dense")
class DenseRetriever(Retriever):
    """Inner-product search of e5 query embeddings in a memory-mapped FAISS index; passages come from a
    memory-mapped corpus whose line offsets are kept next to the index (or at ``offsets_path``)."""

    def __init__(self, index_path: str | os.PathLike, corpus_path: str | os.PathLike,
                 encoder_path: str | os.PathLike, offsets_path: str | os.PathLike | None = None) -> None:
        index_file = _require(index_path, "FAISS index", INDEX_SOURCE)
        corpus_file = _require(corpus_path, "corpus", CORPUS_SOURCE)
        _require(encoder_path, "dense encoder directory", ENCODER_SOURCE)
        self.index = read_index(index_file)
        # Named after the corpus version, so an edited corpus never meets stale offsets.
        offsets = index_file.with_name(f"{index_file.stem}.{file_fingerprint(corpus_file)}.offsets.npy")
        self.corpus = JsonlCorpus(corpus_file, offsets_path or offsets)
        if self.index.ntotal != len(self.corpus):
            self.close()
            raise RetrievalError(f"the FAISS index {index_file} holds {self.index.ntotal} vectors but the corpus "
                                 f"{corpus_file} has {len(self.corpus)} passages; give the corpus the index was "
                                 "built from, or rebuild the index with build_dense_index")
        self.encoder = DenseEncoder(encoder_path)
        if self.index.d != self.encoder.dim:
            self.close()
            raise RetrievalError(f"{index_file} holds {self.index.d}-dimensional vectors but the encoder "
                                 f"{encoder_path} makes {self.encoder.dim}-dimensional ones")

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        k = min(int(k), len(self.corpus))
        if not queries or k <= 0:
            return [[] for _ in queries]
        scores, rows = self.index.search(self.encoder.encode(list(queries), "query"), k)
        return [[Hit(self.corpus[int(row)], float(score)) for row, score in zip(row_ids, row_scores) if row >= 0]
                for row_ids, row_scores in zip(rows, scores)]

    def close(self) -> None:
        self.corpus.close()
