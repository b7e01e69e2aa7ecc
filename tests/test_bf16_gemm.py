"""bf16 products of many rows with AVX512-BF16 dot products (``native/bf16_gemm.cc``, CPUs without AMX): equal to
XLA's fp32-accumulated dot up to rounding, a bf16 result rounded as XLA rounds, taken by mixed_dot for prompts and
training rows, with the pure-JAX model's logits and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import native_kernels
from agentgym_jax.mixed_matmul import mixed_dot
from tests.test_native_kernels import (_use_native_kernels, assert_a_bf16_prompt_runs_its_projections_on,
                                      assert_same_gradients_with_and_without_kernels)

pytestmark = pytest.mark.skipif(not native_kernels.avx512_bf16_available() or native_kernels.amx_available(),
                                reason="this CPU has no AVX512-BF16, or has AMX (amx_gemm takes these products)")


def _gemm_calls(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count(f"@{native_kernels.BF16_GEMM.target}(")


@pytest.mark.parametrize("rows,k,n", [
    (33, 64, 48),  # four blocks of 8 rows and one of 1; one whole panel
    (64, 576, 192),  # four panels: two per thread
    (100, 1536, 96),  # a panel of three strips and one of... three; a tail of 4 rows
    (45, 62, 80),  # K not a multiple of 32; a last panel of two strips
    (41, 1536, 1040),  # 7 MB of w: groups of panels packed in turn; a last panel of two strips
    (37, 4, 16),  # two pairs of k; a single strip
])
def test_products_equal_the_fp32_accumulated_dot(rows, k, n):
    rng = np.random.RandomState(rows + k + n)
    x = jnp.asarray(rng.randn(rows, k), jnp.bfloat16)
    w = jnp.asarray(rng.randn(k, n) * 0.1, jnp.bfloat16)
    ours = np.asarray(jax.jit(native_kernels.bf16_gemm)(x, w))
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert ours.dtype == np.float32 and ours.shape == (rows, n)
    # each pair's products summed in fp32 before they are added: fp32 rounding, in another order than a dot's
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6 * np.sqrt(k) * np.abs(expected).max())


@pytest.mark.parametrize("rows", [64, 45])
def test_a_bf16_result_is_the_fp32_one_rounded_as_xla_rounds_it(rows):
    rng = np.random.RandomState(rows)
    x = rng.randn(rows, 64).astype(np.float32)
    x[0, :] = 0.0
    x[0, :2] = [1.0, 2.0 ** -10]  # row 0 of the product: w[0] + w[1] / 1024
    w = rng.randn(64, 96).astype(np.float32) * 0.1
    w[:2, :4] = [[1.0, 1.0 + 2 ** -7, np.inf, 3e38],  # ties to even (down, up); inf; a large value
                 [4.0, 4.0, -np.inf, 4.0]]
    x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    fp32 = jax.jit(native_kernels.bf16_gemm)(x, w)
    ours = np.asarray(jax.jit(lambda x, w: native_kernels.bf16_gemm(x, w, jnp.bfloat16))(x, w))
    expected = np.asarray(jax.jit(lambda y: y.astype(jnp.bfloat16))(fp32))
    assert ours.dtype == jnp.bfloat16 and ours.shape == (rows, 96)
    np.testing.assert_array_equal(ours.view(np.uint16), expected.view(np.uint16))
    assert np.isnan(np.asarray(fp32)[0, 2])  # inf - inf
    assert np.count_nonzero(ours.view(np.uint16) != np.asarray(fp32).view(np.uint32) >> 16) > 0  # rounded, not cut
    with pytest.raises(TypeError, match="fp32 or bf16"):
        native_kernels.bf16_gemm(x, w, jnp.float16)


def test_mixed_dot_takes_the_kernel_for_bf16_products_of_many_rows(monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    w = jnp.ones((64, 96), jnp.bfloat16)
    product = lambda x, w: mixed_dot(x, w)  # noqa: E731
    assert _gemm_calls(product, jnp.ones((2, 17, 64), jnp.bfloat16), w) == 1  # 34 rows
    assert _gemm_calls(product, jnp.ones((32, 64), jnp.bfloat16), w) == 0  # a decode step's
    assert _gemm_calls(product, jnp.ones((40, 64), jnp.float32), w.astype(jnp.float32)) == 0
    assert _gemm_calls(lambda x, w: mixed_dot(x, w, transposed=True), jnp.ones((40, 96), jnp.bfloat16), w) == 0
    assert _gemm_calls(product, jnp.ones((40, 63), jnp.bfloat16), jnp.ones((63, 96), jnp.bfloat16)) == 0  # K odd
    assert _gemm_calls(product, jnp.ones((40, 64), jnp.bfloat16), jnp.ones((64, 40), jnp.bfloat16)) == 0  # N % 16
    _use_native_kernels(monkeypatch, "0")
    assert _gemm_calls(product, jnp.ones((40, 64), jnp.bfloat16), w) == 0

    assert_same_gradients_with_and_without_kernels(monkeypatch, (3, 40, 64))  # 120 rows: bf16_gemm when on


def test_a_bf16_prompt_runs_its_projections_on_the_kernel_with_the_pure_jax_logits(tmp_path_factory, monkeypatch):
    target = native_kernels.BF16_GEMM.target
    assert_a_bf16_prompt_runs_its_projections_on("bf16_gemm_applies", target, tmp_path_factory, monkeypatch)
