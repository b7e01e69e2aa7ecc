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
    # the prompts' prefill reads the same strips in both (a prefill piece of few positions takes them when given)
    monkeypatch.setattr(in_program, "_prefill_packs", lambda: given._packed)
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


@pytest.mark.skipif(not native_kernels.amx_available(), reason="AMX products of many rows")
@pytest.mark.parametrize("rows", [33, 100, 256])  # whole 32-row blocks and a zero-padded tail
def test_products_of_many_rows_on_given_panels_equal_the_reordering_kernels(rows, monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    rng = np.random.RandomState(rows)
    x = jnp.asarray(rng.randn(rows, 96), jnp.bfloat16)
    state = {"w": jnp.asarray(rng.randn(96, 64), jnp.bfloat16), "up": jnp.asarray(rng.randn(96, 64), jnp.bfloat16)}
    given = {"amx:['w']": native_kernels.pack_for_amx(state["w"]),
             "amx_pair:['w']+['up']": native_kernels.pack_pair_for_amx(state["w"], state["up"])}

    def products(state, given, x):
        with prepacked.replaying(state, given):
            return (native_kernels.amx_gemm(x, state["w"]), native_kernels.amx_gemm(x, state["w"], jnp.bfloat16),
                    native_kernels.amx_swiglu(x, state["w"], state["up"]))

    hlo = jax.jit(products).lower(state, given, x).compile().as_text()
    assert native_kernels.AMX_GEMM_PACKED.target in hlo and native_kernels.AMX_SWIGLU_PACKED_ROWS.target in hlo
    assert f'"{native_kernels.AMX_GEMM.target}"' not in hlo and f'"{native_kernels.AMX_SWIGLU.target}"' not in hlo
    ours = jax.jit(products)(state, given, x)
    theirs = jax.jit(products)(state, {}, x)  # nothing given: each call reorders w itself
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(not native_kernels.amx_available(), reason="bf16 prefill products read the packs on AMX CPUs")
def test_bf16_prefill_reads_the_packs_and_gives_the_same_cache(tmp_path_factory, monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    _, _, model_dir = _pair("qwen2-gqa-untied", tmp_path_factory)
    model = hf.load_model(model_dir, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    program, compiled = sampling.prefill.prefill_program, []
    monkeypatch.setattr(sampling.prefill, "prefill_program", lambda *a, **k: compiled.append(
        program.lower(*a, **k).compile().as_text()) or program(*a, **k))
    caches = []
    for packs in (True, False):
        sampler = Sampler(model, SamplerConfig(cache_length=128))
        if not packs:
            monkeypatch.setattr(sampler, "_packed_weights", lambda batch: {})
        state = sampler.prefill(sampler.new_state(2), [[7] * 40 + [5], [9] * 70])
        caches.append(jax.tree_util.tree_map(np.asarray, (state.cache.keys, state.cache.values)))
    with_packs, without = compiled[0], compiled[len(compiled) // 2]  # each sampler's first call (its longest piece)
    assert native_kernels.AMX_GEMM_PACKED.target in with_packs and native_kernels.AMX_GEMM_PACKED.target not in without
    assert f'"{native_kernels.AMX_GEMM.target}"' not in with_packs and f'"{native_kernels.AMX_GEMM.target}"' in without
    for a, b in zip(jax.tree_util.tree_leaves(caches[0]), jax.tree_util.tree_leaves(caches[1])):
        np.testing.assert_array_equal(a, b)
