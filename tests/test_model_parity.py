"""Logit parity with transformers and the HF -> ours -> HF round trip, on tiny random models."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from agentgym_jax import hf
from tests.tiny_models import VARIANTS, make_hf_model


def _ids(batch: int = 2, length: int = 40, vocab: int = 256, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, (batch, length))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    reference = make_hf_model(variant)
    reference.save_pretrained(tmp_path)
    ours = hf.load_model(tmp_path)
    ids = _ids()
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(ids)))
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "qwen2-gqa-untied", "llama3-rope-scaling", "qwen3-gqa-tied",
                                     "qwen3-mha-untied-bias", "llama32-tied"])
def test_round_trip_is_bit_identical(variant, tmp_path):
    reference = make_hf_model(variant)
    reference.save_pretrained(tmp_path / "in")
    ours = hf.load_model(tmp_path / "in")
    hf.export_model(ours, tmp_path / "out")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert config.model_type == reference.config.model_type
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    expected_state = reference.state_dict()
    got_state = reloaded.state_dict()
    assert set(got_state) == set(expected_state)
    for name, tensor in expected_state.items():
        assert torch.equal(got_state[name], tensor), name


def test_sharded_export_writes_index(tmp_path):
    reference = make_hf_model("llama-mha-untied")
    reference.save_pretrained(tmp_path / "in")
    ours = hf.load_model(tmp_path / "in")
    hf.export_model(ours, tmp_path / "out", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / "out" / s).is_file() for s in shards)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # Our own loader reads the sharded layout back to the same logits.
    again = hf.load_model(tmp_path / "out")
    ids = jnp.asarray(_ids())
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(ours(ids)))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_bf16_parameters_and_compute_run(tmp_path):
    make_hf_model("qwen2-gqa-untied").save_pretrained(tmp_path)
    fp32 = hf.load_model(tmp_path)
    bf16 = hf.load_model(tmp_path, param_dtype="bfloat16", dtype="bfloat16")
    leaf = bf16.model.layers[0].mlp.up_proj.kernel[...]
    assert leaf.dtype == jnp.bfloat16
    ids = jnp.asarray(_ids())
    difference = np.abs(np.asarray(bf16(ids)) - np.asarray(fp32(ids))).max()
    assert 0 < difference < 0.1  # bf16 really used, and still close


def test_remat_gives_same_gradients(tmp_path):
    import jax
    from flax import nnx

    make_hf_model("llama-gqa-tied").save_pretrained(tmp_path)
    ids = jnp.asarray(_ids())

    def grads(remat):
        model = hf.load_model(tmp_path, remat=remat)
        graphdef, params = nnx.split(model)
        loss = lambda p: nnx.merge(graphdef, p)(ids).mean()
        return jax.grad(loss)(params)

    plain, rematted = grads(False), grads(True)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(rematted)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_long_rows_take_the_blocked_attention_and_match_transformers(tmp_path):
    """A 512-token row attends in causal parts of 128-query blocks (attention.attend_causal); logits and the
    gradient of their mean still match transformers."""
    from agentgym_jax import attention

    length = 2 * attention.CAUSAL_PARTS * attention.QUERY_BLOCK
    reference = make_hf_model("llama-gqa-tied", max_position_embeddings=length)
    reference.save_pretrained(tmp_path)
    ours = hf.load_model(tmp_path)
    ids = _ids(batch=1, length=length)
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(ids)))
    assert np.abs(got - expected).max() <= 1e-4

    import jax
    from flax import nnx

    graphdef, params = nnx.split(ours)
    grads = jax.grad(lambda p: nnx.merge(graphdef, p)(jnp.asarray(ids)).mean())(params)
    reference.zero_grad()
    reference(torch.tensor(ids)).logits.mean().backward()
    ours_q = np.asarray(grads["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"][...])
    theirs_q = reference.model.layers[0].self_attn.q_proj.weight.grad.numpy().T
    np.testing.assert_allclose(ours_q, theirs_q, atol=1e-6 + 1e-3 * np.abs(theirs_q).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_embedding_lookup_gathers_bits_with_take_s_values_and_gradients(dtype):
    """A bf16 table is gathered as raw bits (XLA's CPU backend converted the whole table to fp32 for a bf16
    gather); the rows and the table's gradient are those of ``jnp.take``."""
    import jax

    from agentgym_jax import model

    table = jnp.asarray(np.random.RandomState(0).randn(50, 8), dtype)
    tokens = jnp.asarray([[1, 3, 3], [49, 0, 1]])
    np.testing.assert_array_equal(np.asarray(model._embed(table, tokens), np.float32),
                                  np.asarray(jnp.take(table, tokens, axis=0), np.float32))
    weights = jnp.arange(8, dtype=jnp.float32)
    ours = jax.grad(lambda t: (model._embed(t, tokens).astype(jnp.float32) * weights).sum())(table)
    reference = jax.grad(lambda t: (jnp.take(t, tokens, axis=0).astype(jnp.float32) * weights).sum())(table)
    assert ours.dtype == reference.dtype
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(reference, np.float32))
    assert float(np.abs(np.asarray(ours, np.float32))[3].sum()) == 2 * float(weights.sum())  # token 3, twice
    hlo = jax.jit(lambda t: model._embed(t, tokens)).lower(table).compile().as_text()
    assert ("f32[50,8]" in hlo) == (dtype == "float32")
