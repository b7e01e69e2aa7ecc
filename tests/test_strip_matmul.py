"""fp32 decode projections on weights packed into strips (``native/strip_matmul.cc``): the layout, the products
against numpy's, where mixed_dot takes them, and the sampler's fp32 decode loop on them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import hf, native_kernels, sampling
from agentgym_jax.mixed_matmul import mixed_dot
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams
from tests.test_native_kernels import _use_native_kernels
from tests.test_sampling import _pair

pytestmark = pytest.mark.skipif(not native_kernels.avx512_available(), reason="this CPU has no AVX-512")
PACK, PRODUCT = native_kernels.STRIP_PACK.target, native_kernels.STRIP_MATMUL.target


@pytest.mark.parametrize("transposed", [False, True])
def test_strips_hold_sixteen_columns_row_after_row(transposed):
    w = np.arange(7 * 48, dtype=np.float32).reshape(7, 48)  # K = 7, N = 48
    source = jnp.asarray(w.T if transposed else w)
    packed = np.asarray(jax.jit(lambda w: native_kernels.pack_strips(w, transposed))(source))
    assert packed.shape == (3, 7, 16)
    np.testing.assert_array_equal(packed, w.reshape(7, 3, 16).transpose(1, 0, 2))  # strip s, row k, lane c


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows,k,n", [
    (1, 576, 192),  # one row, four panels of three strips
    (8, 100, 80),  # a last panel of two strips
    (9, 7, 16),  # a second pass of one row; a single strip
    (13, 64, 112),  # a pass of 8 rows and one of 5; a last panel of one strip
    (32, 1536, 48),  # four passes of 8 rows
])
def test_products_equal_numpys(rows, k, n, transposed):
    rng = np.random.RandomState(rows + k + n)
    x = rng.randn(rows, k).astype(np.float32)
    w = rng.randn(n, k).astype(np.float32) if transposed else rng.randn(k, n).astype(np.float32)
    ours = jax.jit(lambda x, w: native_kernels.strip_matmul(x, native_kernels.pack_strips(w, transposed)))(x, w)
    expected = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    assert np.abs(expected).max() > 1
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(x).max() * 4)


def _targets(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_mixed_dot_takes_the_kernel_for_fp32_products_of_few_rows_in_packed_loops_only(monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    w = jnp.asarray(np.random.RandomState(0).randn(64, 64) * 0.1, jnp.float32)

    def steps(x, w, transposed=False):
        with native_kernels.packed_projections():
            return jax.lax.fori_loop(0, 4, lambda i, x: mixed_dot(x, w, transposed=transposed), x)

    x = jnp.ones((8, 64), jnp.float32)
    for transposed in (False, True):
        hlo = _targets(lambda x, w: steps(x, w, transposed), x, w)
        body = next(part for part in hlo.split("\n\n") if PRODUCT in part)
        assert PACK not in body  # the product runs in the loop body, its packing once before the loop
        assert hlo.count(f'custom_call_target="{PACK}"') == 1
        np.testing.assert_allclose(np.asarray(jax.jit(lambda x, w: steps(x, w, transposed))(x, w)),
                                   np.asarray(jax.lax.fori_loop(0, 4, lambda i, x: x @ (w.T if transposed else w), x)),
                                   rtol=1e-5)
    assert PRODUCT not in _targets(lambda x, w: mixed_dot(x, w), x, w)  # a single product would pay the packing
    assert PRODUCT not in _targets(steps, jnp.ones((33, 64), jnp.float32), w)  # more than 32 rows
    def narrow(x, w):
        with native_kernels.packed_projections():
            return jax.lax.fori_loop(0, 4, lambda i, x: x * mixed_dot(x, w).mean(-1, keepdims=True), x)

    assert PRODUCT in _targets(narrow, x, w[:, :48])
    assert PRODUCT not in _targets(narrow, x, w[:, :40])  # 40 outputs: not whole strips
    assert PRODUCT not in _targets(steps, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    _use_native_kernels(monkeypatch, "0")
    assert PRODUCT not in _targets(steps, x, w)


def test_fp32_sampling_on_strips_gives_xlas_tokens_and_logprobs(tmp_path_factory, monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    _, _, model_dir = _pair("llama-gqa-tied", tmp_path_factory)  # a tied head: packed transposed
    model = hf.load_model(model_dir)
    program, compiled = sampling._generate_program, []
    monkeypatch.setattr(sampling, "_generate_program", lambda *a, **k: compiled.append(
        program.lower(*a, **k).compile().as_text()) or program(*a, **k))
    outputs = []
    for strips in (True, False):
        applies = native_kernels.strip_matmul_applies
        monkeypatch.setattr(native_kernels, "strip_matmul_applies", lambda *a, on=strips: on and applies(*a))
        jax.clear_caches()
        sampler = Sampler(model, SamplerConfig(cache_length=64))
        prompts = [[7] * 20 + [5], [9] * 25 + [6], [4] * 9]
        _, out = sampler.generate(sampler.new_state(3), prompts, jax.random.PRNGKey(0),
                                  SamplingParams(temperature=1.0, max_new_tokens=8))
        outputs.append(out)
    body = next(part for part in compiled[0].split("\n\n") if PRODUCT in part)
    assert PACK not in body and compiled[0].count(f'custom_call_target="{PACK}"') == 2 * 7 + 1  # and the head
    assert PRODUCT not in compiled[1]
    assert outputs[0].tokens == outputs[1].tokens and len(outputs[0].tokens[0]) == 8
    for a, b in zip(outputs[0].logprobs, outputs[1].logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
