"""bf16 products with fp32 FMAs on widened numbers (``native/pair_strips.cc``): what bf16 strips run on AVX-512 CPUs
without AVX512-BF16. The kernel is tested on every CPU that can build it; where it is the one bf16 strips take, a
prefill's products of many rows read the sampler's strips through it too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import attention, hf, native_kernels
from tests.test_sampling import _pair
from tests.test_strip_matmul import prefill_with_and_without_strips

pytestmark = pytest.mark.skipif(not native_kernels.pair_strips_available(), reason="this CPU has no AVX-512F and BW")
PRODUCT = native_kernels.WIDENED_STRIP_MATMUL.target


def _product(x: np.ndarray, w: np.ndarray, transposed: bool) -> np.ndarray:
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    run = jax.jit(lambda x, w: native_kernels.widened_strip_matmul(x, native_kernels.pack_strips(w, transposed)))
    return np.asarray(run(xb, wb))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows,k,n", [
    (1, 576, 192),  # one row, four panels of three strips
    (7, 6, 16),  # one pass of 7 rows, a single strip
    (13, 100, 80),  # passes of 8 and 5 rows; a last panel of two strips
    (64, 64, 112),  # the most rows that go panel by panel; a last panel of one strip
    (65, 1536, 48),  # the first count that takes the grouped loop, with a pass of one row
    (300, 96, 800),  # groups of several panels, a last pass of 4 rows
])
def test_products_equal_numpys(rows, k, n, transposed):
    rng = np.random.RandomState(rows + k + n)
    x, w = rng.randn(rows, k), rng.randn(n, k) if transposed else rng.randn(k, n)
    ours = _product(x, w, transposed)
    # the bf16 numbers are exact in fp32 and in float64: the sums differ by fp32 rounding only
    xb, wb = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in (x, w))
    expected = xb @ (wb.T if transposed else wb)
    assert ours.shape == (rows, n) and ours.dtype == np.float32 and np.abs(expected).max() > 1
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6 * np.sqrt(k) * np.abs(expected).max())


def test_the_widened_numbers_are_the_bf16_ones_exactly():
    # powers of two and small integers: every product and sum is exact in fp32, so the kernel must give them exactly
    x = np.array([[1.0, -2.0, 0.5, 4.0]], np.float32)
    w = np.arange(4 * 16, dtype=np.float32).reshape(4, 16) - 30  # K = 4: two pair rows, the odd k in the high halves
    np.testing.assert_array_equal(_product(x, w, False), x @ w)


@pytest.mark.skipif(not native_kernels.widened_bf16_available(), reason="AVX512-BF16 or AMX kernels take bf16 here")
def test_a_bf16_prefill_of_many_positions_reads_the_decode_loops_strips(tmp_path_factory, monkeypatch):
    _, _, model_dir = _pair("llama-gqa-tied", tmp_path_factory)
    model = hf.load_model(model_dir, param_dtype="bfloat16", dtype="bfloat16")
    rs = np.random.RandomState(0)
    many = [rs.randint(3, 200, 128).tolist() for _ in range(3)]  # 4 rows x 128 positions: 512 rows a product
    compiled, caches, samplers = prefill_with_and_without_strips(monkeypatch, model, [(4, many)])
    caches = [only for only, in caches]
    assert [bool(sampler._packed) for sampler in samplers] == [True, False]  # packed by the sampler, once per update
    assert PRODUCT in compiled[0] and native_kernels.STRIP_PACK_BF16.target not in compiled[0]
    assert PRODUCT not in compiled[1]
    for ours, xlas in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
        ours, xlas = (np.asarray(attention.from_storage(a, jnp.bfloat16), np.float32) for a in (ours, xlas))
        # bf16 keys and values from fp32 sums in another order: at most a few bf16 steps apart
        assert np.abs(xlas).max() > 0.1
        np.testing.assert_allclose(ours, xlas, rtol=0, atol=0.05 * np.abs(xlas).max())
