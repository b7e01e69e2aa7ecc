"""Decode projections on weights packed into strips (``native/strip_matmul.cc``), fp32 and (on CPUs without AMX)
bf16: the layout, the products against numpy's, where mixed_dot takes them, and the sampler's decode loop on them.
bf16 strips run AVX512-BF16 dot products (``native/bf16_gemm.cc``) or, on AVX-512 CPUs without them, fp32 FMAs on
the widened numbers (``native/pair_strips.cc``; more in tests/test_pair_strips.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import hf, native_kernels, prefill, sampling
from agentgym_jax.mixed_matmul import mixed_dot
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams
from tests.test_native_kernels import _use_native_kernels
from tests.test_sampling import _pair

pytestmark = pytest.mark.skipif(not native_kernels.avx512_available(), reason="this CPU has no AVX-512")
PACK, PRODUCT = native_kernels.STRIP_PACK.target, native_kernels.STRIP_MATMUL.target
WIDENED = native_kernels.widened_bf16_available()
PACK_BF16 = native_kernels.STRIP_PACK_BF16.target
PRODUCT_BF16 = (native_kernels.WIDENED_STRIP_MATMUL if WIDENED else native_kernels.STRIP_MATMUL_BF16).target
BF16_STRIPS = WIDENED or (native_kernels.avx512_bf16_available() and not native_kernels.amx_available())
DTYPES = [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.skipif(
    not BF16_STRIPS, reason="AMX tiles take bf16 decode products where present"))]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("k", [7, 37])  # 37: two whole blocks of 16 rows (16 x 16 transposes) and 5 more
def test_fp32_strips_hold_sixteen_columns_row_after_row(transposed, k):
    w = np.arange(k * 48, dtype=np.float32).reshape(k, 48)  # N = 48
    source = jnp.asarray(w.T if transposed else w)
    packed = np.asarray(jax.jit(lambda w: native_kernels.pack_strips(w, transposed))(source))
    assert packed.shape == (3, k, 16)
    np.testing.assert_array_equal(packed, w.reshape(k, 3, 16).transpose(1, 0, 2))  # strip s, row k, lane c


@pytest.mark.skipif(not BF16_STRIPS, reason="AMX tiles take bf16 decode products where present")
@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_strips_hold_sixteen_columns_in_pairs_of_rows(transposed):
    w = np.arange(8 * 48, dtype=np.float32).reshape(8, 48) - 192  # K = 8, N = 48; |w| <= 192: integers in bf16
    source = jnp.asarray(w.T if transposed else w, jnp.bfloat16)
    packed = jax.jit(lambda w: native_kernels.pack_strips(w, transposed))(source)
    assert packed.shape == (3, 4, 16, 2) and packed.dtype == jnp.bfloat16
    # strip s, pair row j, lane c, member i: w[2j + i, 16s + c]
    np.testing.assert_array_equal(np.asarray(packed, np.float32), w.reshape(4, 2, 3, 16).transpose(2, 0, 3, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows,k,n", [
    (1, 576, 192),  # one row, four panels of three strips
    (8, 100, 80),  # a last panel of two strips
    (9, 6, 16),  # a second pass of one row; a single strip
    (13, 64, 112),  # a pass of 8 rows and one of 5; a last panel of one strip
    (32, 1536, 48),  # four passes of 8 rows
])
def test_products_equal_numpys(rows, k, n, transposed, dtype):
    rng = np.random.RandomState(rows + k + n)
    x = jnp.asarray(rng.randn(rows, k), dtype)
    w = jnp.asarray(rng.randn(n, k) if transposed else rng.randn(k, n), dtype)
    ours = jax.jit(lambda x, w: native_kernels.strip_matmul(x, native_kernels.pack_strips(w, transposed)))(x, w)
    assert ours.dtype == jnp.float32
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)  # bf16 numbers are exact in fp32: fp32 sums either way
    expected = x @ (w.T if transposed else w)
    assert np.abs(expected).max() > 1
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(x).max() * 4)


@pytest.mark.parametrize("rows", [64, 100, 256])  # fp32 strips take decode batches beyond 32 rows: 8 rows a pass
def test_fp32_products_of_many_rows_equal_numpys(rows):
    rng = np.random.RandomState(rows)
    x, w = rng.randn(rows, 96).astype(np.float32), rng.randn(96, 80).astype(np.float32)
    ours = jax.jit(lambda x, w: native_kernels.strip_matmul(x, native_kernels.pack_strips(w)))(x, w)
    np.testing.assert_allclose(np.asarray(ours), x.astype(np.float64) @ w, rtol=0, atol=1e-4)


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
    assert PRODUCT in _targets(steps, jnp.ones((64, 64), jnp.float32), w)  # a decode batch of 64 rows
    rows = native_kernels.STRIP_MAX_ROWS + 1
    assert PRODUCT not in _targets(steps, jnp.ones((rows, 64), jnp.float32), w)  # more rows: XLA's dots
    def narrow(x, w):
        with native_kernels.packed_projections():
            return jax.lax.fori_loop(0, 4, lambda i, x: x * mixed_dot(x, w).mean(-1, keepdims=True), x)

    assert PRODUCT in _targets(narrow, x, w[:, :48])
    assert PRODUCT not in _targets(narrow, x, w[:, :40])  # 40 outputs: not whole strips
    bf16 = _targets(steps, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    if BF16_STRIPS:
        assert PRODUCT_BF16 in bf16 and bf16.count(f'custom_call_target="{PACK_BF16}"') == 1
    else:  # AMX tiles take bf16 products of few rows, or XLA's dots do
        assert PRODUCT_BF16 not in bf16
    _use_native_kernels(monkeypatch, "0")
    assert PRODUCT not in _targets(steps, x, w)


def test_fp32_sampling_on_strips_gives_xlas_tokens_and_logprobs(tmp_path_factory, monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    _, _, model_dir = _pair("llama-gqa-tied", tmp_path_factory)  # a tied head: packed transposed
    model = hf.load_model(model_dir)
    program, compiled = sampling._generate_program, []
    monkeypatch.setattr(sampling, "_generate_program", lambda *a, **k: compiled.append(
        program.lower(*a, **k).compile().as_text()) or program(*a, **k))
    outputs, samplers = [], []
    for strips in (True, False):
        applies = native_kernels.strip_matmul_applies
        monkeypatch.setattr(native_kernels, "strip_matmul_applies", lambda *a, on=strips: on and applies(*a))
        jax.clear_caches()
        sampler = Sampler(model, SamplerConfig(cache_length=64))
        samplers.append(sampler)
        prompts = [[7] * 20 + [5], [9] * 25 + [6], [4] * 9]
        _, out = sampler.generate(sampler.new_state(3), prompts, jax.random.PRNGKey(0),
                                  SamplingParams(temperature=1.0, max_new_tokens=8))
        outputs.append(out)
    # the loop reads strips packed once per parameter update (the sampler's pack program), none packed in it
    assert PRODUCT in compiled[0] and PACK not in compiled[0] and len(samplers[0]._packed) == 2 * 7 + 1  # + head
    assert PRODUCT not in compiled[1]
    assert outputs[0].tokens == outputs[1].tokens and len(outputs[0].tokens[0]) == 8
    for a, b in zip(outputs[0].logprobs, outputs[1].logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.skipif(not BF16_STRIPS, reason="AMX tiles take bf16 decode products where present")
def test_bf16_sampling_on_strips_gives_xlas_tokens_and_logprobs(tmp_path_factory, monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    _, _, model_dir = _pair("llama-gqa-tied", tmp_path_factory)
    model = hf.load_model(model_dir, param_dtype="bfloat16", dtype="bfloat16")
    outputs, compiled, samplers = [], [], []
    program = sampling._generate_program
    monkeypatch.setattr(sampling, "_generate_program", lambda *a, **k: compiled.append(
        program.lower(*a, **k).compile().as_text()) or program(*a, **k))
    for strips in (True, False):
        applies = native_kernels.strip_matmul_applies
        monkeypatch.setattr(native_kernels, "strip_matmul_applies", lambda *a, on=strips: on and applies(*a))
        jax.clear_caches()
        sampler = Sampler(model, SamplerConfig(cache_length=64))
        samplers.append(sampler)
        _, out = sampler.generate(sampler.new_state(2), [[7] * 20 + [5], [9] * 25 + [6]], jax.random.PRNGKey(0),
                                  SamplingParams(temperature=0.0, max_new_tokens=8))
        outputs.append(out)
    assert PRODUCT_BF16 in compiled[0] and PACK_BF16 not in compiled[0] and len(samplers[0]._packed) == 2 * 7 + 1
    assert PRODUCT_BF16 not in compiled[1]
    assert outputs[0].tokens == outputs[1].tokens and len(outputs[0].tokens[0]) == 8
    for a, b in zip(outputs[0].logprobs, outputs[1].logprobs):  # bf16 projections: sums in another order, rounded
        np.testing.assert_allclose(a, b, atol=2e-2)


def prefill_with_and_without_strips(monkeypatch, model, calls):
    """``sampler.prefill(sampler.new_state(rows), prompts)`` for each (rows, prompts) of ``calls`` on a fresh sampler,
    first with strip products allowed, then with them off (programs traced anew each time). Returns the compiled
    prefill programs' HLO texts in order, the caches of each pass's calls, and the two samplers."""
    _use_native_kernels(monkeypatch, "1")
    program, compiled = prefill.prefill_program, []
    monkeypatch.setattr(prefill, "prefill_program", lambda *a, **k: compiled.append(
        program.lower(*a, **k).compile().as_text()) or program(*a, **k))
    caches, samplers = [], []
    for strips in (True, False):
        applies = native_kernels.strip_matmul_applies
        monkeypatch.setattr(native_kernels, "strip_matmul_applies", lambda *a, on=strips: on and applies(*a))
        jax.clear_caches()
        sampler = Sampler(model, SamplerConfig(cache_length=160, prefill_chunk=0, prefill_call_cost=0))
        samplers.append(sampler)
        caches.append([sampler.prefill(sampler.new_state(rows), prompts).cache for rows, prompts in calls])
    return compiled, caches, samplers


def test_a_prefill_piece_of_few_positions_reads_the_decode_loops_strips(tmp_path_factory, monkeypatch):
    _, _, model_dir = _pair("llama-gqa-tied", tmp_path_factory)
    rs = np.random.RandomState(0)
    few = [rs.randint(3, 200, n).tolist() for n in (20, 25)]  # 2 rows x 32 positions
    many = [rs.randint(3, 200, 128).tolist() for _ in range(3)]  # 4 rows x 128 positions: XLA's dots
    compiled, caches, samplers = prefill_with_and_without_strips(monkeypatch, hf.load_model(model_dir),
                                                                 [(2, few), (4, many)])
    caches = [first for first, _ in caches]
    # the sampler's strips (packed once per parameter update) are an argument: the piece packs none itself
    assert PRODUCT in compiled[0] and PACK not in compiled[0] and len(samplers[0]._packed) == 2 * 7 + 1
    assert PRODUCT not in compiled[1] and PRODUCT not in compiled[2] + compiled[3]
    for ours, xlas in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(xlas), atol=1e-5)
