"""bf16 products of many rows on AMX tiles (``amx_gemm`` in ``native/amx_matmul.cc``): equal to XLA's
fp32-accumulated dot, taken by mixed_dot for prompts and training rows, with the pure-JAX model's logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import native_kernels
from agentgym_jax.mixed_matmul import mixed_dot
from tests.test_native_kernels import (_use_native_kernels, assert_a_bf16_prompt_runs_its_projections_on,
                                      assert_same_gradients_with_and_without_kernels)

pytestmark = pytest.mark.skipif(not native_kernels.amx_available(), reason="this CPU has no AMX bf16 tiles")


def _gemm_calls(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count(f"@{native_kernels.AMX_GEMM.target}(")


@pytest.mark.parametrize("rows,k,n", [
    (33, 64, 32),  # one whole block of 32 rows and a padded one of 1
    (64, 576, 192),  # whole blocks only
    (100, 1536, 96),  # three panels: an odd count over the threads
    (64, 1536, 1024),  # 3 MB of panels reordered: groups of at most 1 MB per thread
    (545, 32, 576),  # a single k block; 17 blocks and a tail of 1
])
def test_products_equal_the_fp32_accumulated_dot(rows, k, n):
    rng = np.random.RandomState(rows + k + n)
    x = jnp.asarray(rng.randn(rows, k), jnp.bfloat16)
    w = jnp.asarray(rng.randn(k, n) * 0.1, jnp.bfloat16)
    ours = np.asarray(jax.jit(native_kernels.amx_gemm)(x, w))
    expected = np.asarray(jax.lax.dot(x, w, preferred_element_type=jnp.float32))
    assert ours.dtype == np.float32 and ours.shape == (rows, n)
    # the products of bf16 numbers are exact in fp32; only the order of the fp32 sums may differ
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("rows", [64, 45])  # whole blocks; a tail of 13 rows
def test_a_bf16_result_is_the_fp32_one_rounded_as_xla_rounds_it(rows):
    rng = np.random.RandomState(rows)
    x = rng.randn(rows, 64).astype(np.float32)
    x[0, :] = 0.0
    x[0, :2] = [1.0, 2.0 ** -10]  # row 0 of the product: w[0] + w[1] / 1024
    w = rng.randn(64, 96).astype(np.float32) * 0.1
    # ties to even (down, up); a subnormal (AMX flushes it); NaN; a large value
    w[:2, :5] = [[1.0, 1.0 + 2 ** -7, 1e-39, np.inf, 3e38],
                 [4.0, 4.0, 2.0 ** -130, -np.inf, 4.0]]
    x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    fp32 = jax.jit(native_kernels.amx_gemm)(x, w)
    ours = np.asarray(jax.jit(lambda x, w: native_kernels.amx_gemm(x, w, jnp.bfloat16))(x, w))
    expected = np.asarray(jax.jit(lambda y: y.astype(jnp.bfloat16))(fp32))
    assert ours.dtype == jnp.bfloat16 and ours.shape == (rows, 96)
    np.testing.assert_array_equal(ours.view(np.uint16), expected.view(np.uint16))
    assert np.count_nonzero(ours.view(np.uint16) != np.asarray(fp32).view(np.uint32) >> 16) > 0  # rounded, not cut
    with pytest.raises(TypeError, match="fp32 or bf16"):
        native_kernels.amx_gemm(x, w, jnp.float16)


def test_mixed_dot_takes_the_kernel_for_bf16_products_of_many_rows(monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    w = jnp.ones((64, 96), jnp.bfloat16)
    product = lambda x, w: mixed_dot(x, w)  # noqa: E731
    assert _gemm_calls(product, jnp.ones((2, 17, 64), jnp.bfloat16), w) == 1  # 34 rows
    assert _gemm_calls(product, jnp.ones((32, 64), jnp.bfloat16), w) == 0  # a decode step's: amx_matmul
    assert _gemm_calls(product, jnp.ones((40, 64), jnp.float32), w.astype(jnp.float32)) == 0
    assert _gemm_calls(lambda x, w: mixed_dot(x, w, transposed=True), jnp.ones((40, 96), jnp.bfloat16), w) == 0
    assert _gemm_calls(product, jnp.ones((40, 48), jnp.bfloat16), jnp.ones((48, 96), jnp.bfloat16)) == 0  # K % 32
    _use_native_kernels(monkeypatch, "0")
    assert _gemm_calls(product, jnp.ones((40, 64), jnp.bfloat16), w) == 0

    assert_same_gradients_with_and_without_kernels(monkeypatch, (3, 40, 64))  # 120 rows: amx_gemm when on


def test_a_bf16_prompt_runs_its_projections_on_the_kernel_with_the_pure_jax_logits(tmp_path_factory, monkeypatch):
    target = native_kernels.AMX_GEMM.target
    assert_a_bf16_prompt_runs_its_projections_on("amx_gemm_applies", target, tmp_path_factory, monkeypatch)
