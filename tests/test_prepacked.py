"""The decode loop's weights packed once per parameter update (agentgym_jax.prepacked, the sampler's pack program):
the same tokens and log-probabilities as packing inside each generate call, no packing left in the generate
program, one pack per update, and never stale packs after update_params."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import hf, native_kernels, prepacked, sampling
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams
from tests.test_native_kernels import _use_native_kernels
from tests.test_sampling import _pair

pytestmark = pytest.mark.skipif(not native_kernels.avx512_available(), reason="packed decode kernels need AVX-512")
PROMPTS = [[7] * 20 + [5], [9] * 25 + [6], [4] * 9]
PACKS = {jnp.float32: native_kernels.STRIP_PACK.target, jnp.bfloat16: native_kernels.AMX_PACK.target}


def _generate(sampler: Sampler, temperature: float = 1.0):
    _, out = sampler.generate(sampler.new_state(len(PROMPTS)), PROMPTS, jax.random.PRNGKey(3),
                              SamplingParams(temperature=temperature, max_new_tokens=8))
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.skipif(
    not native_kernels.amx_available(), reason="bf16 decode products read packed weights on AMX CPUs here"))])
def test_packs_made_once_give_the_in_program_packs_tokens_and_none_are_left_in_the_program(
        dtype, tmp_path_factory, monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    _, _, model_dir = _pair("llama-gqa-tied", tmp_path_factory)
    model = hf.load_model(model_dir, param_dtype=dtype, dtype=dtype)
    program, compiled = sampling._generate_program, []
    monkeypatch.setattr(sampling, "_generate_program", lambda *a, **k: compiled.append(
        program.lower(*a, **k).compile().as_text()) or program(*a, **k))
    packs_made = []
    pack_program = sampling.pack_program
    monkeypatch.setattr(sampling, "pack_program", lambda *a, **k: packs_made.append(1) or pack_program(*a, **k))

    given = Sampler(model, SamplerConfig(cache_length=64))
    outputs = [_generate(given), _generate(given, temperature=0.0)]
    in_program = Sampler(model, SamplerConfig(cache_length=64))
    monkeypatch.setattr(in_program, "_packed_weights", lambda batch: {})
    outputs += [_generate(in_program), _generate(in_program, temperature=0.0)]

    assert len(packs_made) == 1  # two calls, one pack
    # 2 layers x 7 projections and the tied head in fp32; AMX: q, k, v, o, down per layer and gate + up in pairs
    assert len(given._packed) == (2 * 7 + 1 if dtype == jnp.float32 else 2 * 6)
    pack = f'custom_call_target="{PACKS[dtype]}"'
    assert pack not in compiled[0] and pack not in compiled[1]  # the generate programs given the packs
    assert compiled[2].count(pack) >= 10  # the same programs packing for themselves
    for ours, theirs in ((outputs[0], outputs[2]), (outputs[1], outputs[3])):
        assert ours.tokens == theirs.tokens and len(ours.tokens[0]) == 8
        for a, b in zip(ours.logprobs, theirs.logprobs):
            np.testing.assert_array_equal(a, b)


def test_new_parameters_are_packed_again_and_release_frees_the_packs(tmp_path_factory, monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    _, _, model_dir = _pair("llama-gqa-tied", tmp_path_factory)
    model = hf.load_model(model_dir)
    other = jax.tree_util.tree_map(lambda leaf: leaf * 1.5, nnx.state(model))
    sampler = Sampler(model, SamplerConfig(cache_length=64))
    first = _generate(sampler, temperature=0.0)
    sampler.update_params(other)
    assert sampler._packed is None
    moved = _generate(sampler, temperature=0.0)
    fresh_model = hf.load_model(model_dir)
    nnx.update(fresh_model, other)
    expected = _generate(Sampler(fresh_model, SamplerConfig(cache_length=64)), temperature=0.0)
    assert moved.tokens == expected.tokens and moved.tokens != first.tokens
    for a, b in zip(moved.logprobs, expected.logprobs):
        np.testing.assert_array_equal(a, b)
    sampler.release_packed()
    assert sampler._packed is None and _generate(sampler, temperature=0.0).tokens == expected.tokens


def test_a_pack_is_taken_from_the_given_arrays_only_for_its_own_leaves():
    state = {"a": jnp.ones((2, 2)), "b": jnp.zeros((2, 2))}
    made_here = jnp.full((4,), 7.0)
    with prepacked.recording(state) as made:
        assert prepacked.packed("kind", (state["a"],), lambda: made_here) is made_here
        assert prepacked.packed("kind", (state["a"] + 1,), lambda: jnp.zeros(1)).shape == (1,)  # not a leaf
    assert list(made) == ["kind:['a']"]
    with prepacked.replaying(state, {"kind:['a']": made_here}):
        assert prepacked.packed("kind", (state["a"],), lambda: None) is made_here
        assert prepacked.packed("other", (state["a"],), lambda: made_here + 1)[0] == 8  # another kind: packed here
        assert prepacked.packed("kind", (state["a"], state["b"]), lambda: made_here - 1)[0] == 6
    assert prepacked.packed("kind", (state["a"],), lambda: made_here * 0)[0] == 0  # outside both: packed
