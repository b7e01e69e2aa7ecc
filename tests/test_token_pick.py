"""The native token pick (``native/token_pick.cc``): greedy picks and inverse-CDF draws equal to the pure-JAX
draw_tokens', never a zero-probability token, the drawn distribution, and where draw_tokens takes it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import native_kernels, token_draws
from tests.test_native_kernels import _use_native_kernels

pytestmark = pytest.mark.skipif(not native_kernels.avx512_available(), reason="this CPU has no AVX-512")
pick = jax.jit(native_kernels.token_pick, static_argnums=3)


def _reference(logits: np.ndarray, temperature: np.ndarray, uniform: np.ndarray, logprob_temperature: float):
    """float64 numpy: the first maximum, or the first index whose cumulative probability exceeds the uniform."""
    x = logits.astype(np.float64)
    tokens = []
    for row, t, u in zip(x, temperature, uniform):
        if t == 0:
            tokens.append(int(np.argmax(row)))
            continue
        p = np.exp((row - row.max()) / max(t, 1e-6))
        tokens.append(int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right")))
    scaled = x / logprob_temperature
    lse = scaled.max(1) + np.log(np.exp(scaled - scaled.max(1, keepdims=True)).sum(1))
    return np.asarray(tokens), scaled[np.arange(len(x)), tokens] - lse


@pytest.mark.parametrize("vocab", [5, 37, 1000, 49152])  # one partial block; a whole-and-partial mix; SmolLM2's
@pytest.mark.parametrize("logprob_temperature", [1.0, 0.7])
def test_picks_and_log_probs_equal_the_reference(vocab, logprob_temperature):
    rng = np.random.RandomState(vocab)
    rows = 24
    logits = (rng.randn(rows, vocab) * 2).astype(np.float32)
    logits[3, [1, 4]] = logits[3].max() + 1  # a tie for the maximum: the first wins
    temperature = np.where(np.arange(rows) % 3 == 0, 0.0, rng.uniform(0.3, 1.5, rows)).astype(np.float32)
    uniform = rng.uniform(0, 1, rows).astype(np.float32)
    tokens, logprobs = pick(logits, temperature, uniform, logprob_temperature)
    expected_tokens, expected_logprobs = _reference(logits, temperature, uniform, logprob_temperature)
    assert tokens.dtype == jnp.int32 and int(tokens[3]) == 1
    np.testing.assert_array_equal(np.asarray(tokens), expected_tokens)
    np.testing.assert_allclose(np.asarray(logprobs), expected_logprobs, atol=2e-5)


def test_zero_probability_tokens_are_never_drawn_even_at_the_ends_of_the_uniform():
    with np.errstate(divide="ignore"):
        logits = np.log(np.asarray([[0.0, 0.5, 0.0, 0.5, 0.0] * 7], np.float32))  # 14 tokens of 1/14, -inf between
    rows = np.repeat(logits, 4, 0)
    uniform = np.asarray([0.0, 0.55, 0.999999, np.nextafter(np.float32(1), np.float32(0))], np.float32)
    tokens, logprobs = pick(rows, np.ones(4, np.float32), uniform, 1.0)
    assert np.asarray(tokens).tolist() == [1, 18, 33, 33]
    np.testing.assert_allclose(np.asarray(logprobs), np.log(1 / 14), rtol=1e-5)


def test_a_row_with_a_nan_gets_what_the_pure_jax_path_gives_it(monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    logits = np.random.RandomState(3).randn(4, 40).astype(np.float32)
    logits[1, 7] = logits[3, 30] = np.nan
    temperature = jnp.asarray([0.0, 0.0, 0.9, 0.9], jnp.float32)
    native = _draw(jnp.asarray(logits), temperature)
    _use_native_kernels(monkeypatch, "0")
    pure = _draw(jnp.asarray(logits), temperature)
    np.testing.assert_array_equal(np.asarray(native[0]), np.asarray(pure[0]))
    assert np.asarray(native[0])[[1, 3]].tolist() == [39, 0]  # greedy: the last token; drawn: the first
    assert np.isnan(np.asarray(native[1])[[1, 3]]).all() and np.isfinite(np.asarray(native[1])[[0, 2]]).all()
    np.testing.assert_allclose(np.asarray(native[1])[[0, 2]], np.asarray(pure[1])[[0, 2]], atol=2e-5)


def test_draws_follow_the_softmax():
    probabilities = np.asarray([0.5, 0.3, 0.0, 0.15, 0.05])
    draws = 20000
    with np.errstate(divide="ignore"):
        logits = np.broadcast_to(np.log(probabilities).astype(np.float32), (draws, 5))
    uniform = np.asarray(jax.random.uniform(jax.random.PRNGKey(5), (draws,)))
    tokens, _ = pick(logits, np.full(draws, 2.0, np.float32), uniform, 1.0)  # temperature 2: p ** 0.5, renormalized
    expected = np.sqrt(probabilities) / np.sqrt(probabilities).sum()
    counts = np.bincount(np.asarray(tokens), minlength=5) / draws
    assert counts[2] == 0.0
    np.testing.assert_allclose(counts, expected, atol=0.016)  # 4.5 standard errors at n = 20000


def _draw(logits, temperature, filtered=False):
    rows = logits.shape[0]
    return jax.jit(lambda logits, temperature: token_draws.draw_tokens(
        logits, jax.random.split(jax.random.PRNGKey(0), rows), jnp.arange(rows), temperature,
        jnp.full((rows,), 0.9), jnp.full((rows,), 50, jnp.int32), filtered, 0.8))(logits, temperature)


def test_draw_tokens_takes_the_kernel_unfiltered_and_gives_the_pure_jax_samples(monkeypatch):
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.randn(16, 3000) * 3, jnp.float32)
    temperature = jnp.asarray(np.where(np.arange(16) < 5, 0.0, 0.8), jnp.float32)
    lowered = lambda *a: jax.jit(  # noqa: E731
        lambda l, t: token_draws.draw_tokens(l, jax.random.split(jax.random.PRNGKey(0), 16), jnp.arange(16), t,
                                             jnp.ones(16), jnp.zeros(16, jnp.int32), *a)).lower(logits, temperature)
    _use_native_kernels(monkeypatch, "1")
    native = _draw(logits, temperature)
    assert native_kernels.TOKEN_PICK.target in lowered(False).as_text()
    assert native_kernels.TOKEN_PICK.target not in lowered(True).as_text()  # top-k / top-p: the pure-JAX path
    assert not native_kernels.token_pick_applies(logits.astype(jnp.bfloat16))
    _use_native_kernels(monkeypatch, "0")
    assert native_kernels.TOKEN_PICK.target not in lowered(False).as_text()
    pure = _draw(logits, temperature)
    np.testing.assert_array_equal(np.asarray(native[0]), np.asarray(pure[0]))
    np.testing.assert_allclose(np.asarray(native[1]), np.asarray(pure[1]), atol=2e-5)
