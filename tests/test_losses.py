"""Losses and aggregation against hand-computed numbers and independent numpy formulas."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import losses

TWO_TURNS = [0, 0, 1, 1, 0, 0, 1, 1, 0]


def f32(x) -> jnp.ndarray:
    return jnp.asarray(np.asarray(x, np.float32))


# ------------------------------------------------------------------------------------------ aggregation

LOSS = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
MASK = np.array([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]], np.float32)


@pytest.mark.parametrize(
    "mode, numerator, denominator",
    [
        ("token-mean", 1 + 2 + 20 + 30 + 40, 5),
        ("seq-mean-token-mean", 1.5 + 30.0, 2),  # row means 1.5 and 30; the empty row is not a sequence
        ("seq-mean-token-sum", 3 + 90, 2),
    ],
)
def test_aggregation_hand_computed(mode, numerator, denominator):
    num, den = losses.aggregate_loss(mode, f32(LOSS), f32(MASK))
    assert float(num) == pytest.approx(numerator)
    assert float(den) == pytest.approx(denominator)


def test_aggregation_ignores_nan_off_the_mask():
    loss = LOSS.copy()
    loss[MASK == 0] = np.nan
    for mode in losses.LOSS_AGGREGATIONS:
        num, den = losses.aggregate_loss(mode, f32(loss), f32(MASK))
        assert np.isfinite(float(num)) and float(den) > 0


def test_unknown_aggregation_lists_valid_names():
    with pytest.raises(losses.LossConfigError, match="valid names: seq-mean-token-mean, seq-mean-token-sum, token-mean"):
        losses.aggregate_loss("mean", f32(LOSS), f32(MASK))


def _toy_loss_parts(params, batch, mode):
    """A policy-gradient-like loss through a tiny linear policy; returns (numerator, denominator)."""
    features, targets, advantages, mask = batch
    logits = jnp.einsum("btd,dv->btv", features, params)
    logp = losses.logprobs_from_logits(logits, targets)
    per_token = losses.ppo_clip_loss(logp, jax.lax.stop_gradient(logp) - 0.1, advantages).loss
    return losses.aggregate_loss(mode, per_token, mask)


@pytest.mark.parametrize("mode", sorted(losses.LOSS_AGGREGATIONS))
def test_one_batch_equals_k_micro_batches(mode):
    rng = np.random.default_rng(0)
    batch, length, dim, vocab = 8, 9, 4, 6
    mask = (rng.random((batch, length)) < 0.5).astype(np.float32)
    mask[0] = TWO_TURNS
    mask[5] = 0.0  # a padding row
    data = (
        f32(rng.normal(size=(batch, length, dim))),
        jnp.asarray(rng.integers(0, vocab, size=(batch, length)), jnp.int32),
        f32(rng.normal(size=(batch, length))),
        f32(mask),
    )
    params = f32(rng.normal(size=(dim, vocab)) * 0.5)

    def mean_loss(p, b):
        num, den = _toy_loss_parts(p, b, mode)
        return num / den

    full_loss, full_grad = jax.value_and_grad(mean_loss)(params, data)

    # Differentiate the numerator only; the denominator rides along as aux.
    num_grad_fn = jax.jit(jax.value_and_grad(functools.partial(_toy_loss_parts, mode=mode), has_aux=True))
    total_num, total_den, total_grad = 0.0, 0.0, jnp.zeros_like(params)
    for k in range(4):  # micro-batches of 2 rows, unequal token counts
        micro = tuple(x[2 * k : 2 * k + 2] for x in data)
        (num, den), grad = num_grad_fn(params, micro)
        total_num, total_den, total_grad = total_num + num, total_den + den, total_grad + grad
    np.testing.assert_allclose(float(total_num / total_den), float(full_loss), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(total_grad / total_den), np.asarray(full_grad), rtol=1e-6, atol=1e-6)
    # Averaging per-micro-batch means would differ (the trap this API avoids), at least for token-mean.
    if mode == "token-mean":
        micro_means = []
        for k in range(4):
            num, den = _toy_loss_parts(params, tuple(x[2 * k : 2 * k + 2] for x in data), mode)
            micro_means.append(float(num / den))
        assert abs(np.mean(micro_means) - float(full_loss)) > 1e-3


def test_gradient_ignores_environment_positions():
    """Perturbing the logits at masked (environment) positions changes neither the loss nor other gradients."""
    rng = np.random.default_rng(1)
    mask = np.array([TWO_TURNS, [0, 1, 1, 0, 0, 0, 0, 0, 0]], np.float32)
    logits = rng.normal(size=(2, 9, 5)).astype(np.float32)
    targets = jnp.asarray(rng.integers(0, 5, size=(2, 9)), jnp.int32)
    advantages = f32(rng.normal(size=(2, 9)))
    old_logp = f32(rng.normal(size=(2, 9)) - 1.5)
    ref_logp = f32(rng.normal(size=(2, 9)) - 1.5)

    def total_loss(z):
        logp = losses.logprobs_from_logits(z, targets)
        pg = losses.ppo_clip_loss(logp, old_logp, advantages, clip_ratio_c=3.0).loss
        kl = losses.kl_k3(logp, ref_logp)
        ent = losses.entropy_from_logits(z)
        num, den = losses.aggregate_loss("seq-mean-token-mean", pg + 0.01 * kl - 0.001 * ent, f32(mask))
        return num / den

    perturbed = logits.copy()
    perturbed[mask == 0] += rng.normal(size=perturbed[mask == 0].shape).astype(np.float32) * 10
    loss_a, grad_a = jax.value_and_grad(total_loss)(f32(logits))
    loss_b, grad_b = jax.value_and_grad(total_loss)(f32(perturbed))
    assert float(loss_a) == float(loss_b)
    np.testing.assert_array_equal(np.asarray(grad_a), np.asarray(grad_b))
    assert np.all(np.asarray(grad_a)[mask == 0] == 0.0)
    assert np.all(np.abs(np.asarray(grad_a)[mask > 0]).sum(-1) > 0)


# ------------------------------------------------------------------------------------------ PPO-clip


def test_ppo_clip_hand_computed_cases():
    # (ratio, advantage): expected loss, clipped?, for clip_low = 0.2, clip_high = 0.28
    ratio = np.array([[2.0, 1.1, 0.5, 0.5, 1.5, 0.9]], np.float32)
    advantage = np.array([[1.0, 1.0, 1.0, -1.0, -1.0, -2.0]], np.float32)
    old = np.log(np.full_like(ratio, 0.1))
    logp = old + np.log(ratio)
    out = losses.ppo_clip_loss(f32(logp), f32(old), f32(advantage), clip_low=0.2, clip_high=0.28)
    expected = [
        -1.28,  # A>0, ratio above 1+0.28: clipped at 1.28
        -1.1,  # A>0, inside the range
        -0.5,  # A>0, below 1-0.2: the unclipped (smaller) ratio wins, max(-0.5, -0.8) = -0.5
        0.8,  # A<0, below 1-0.2: clipped at 0.8 -> max(0.5, 0.8)
        1.5,  # A<0, above: unclipped max(1.5, 1.28)
        1.8,  # A<0 inside
    ]
    np.testing.assert_allclose(np.asarray(out.loss)[0], expected, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.clipped)[0], [1, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(out.dual_clipped)[0], 0)
    np.testing.assert_allclose(np.asarray(out.ratio)[0], ratio[0], rtol=1e-5)


def test_dual_clip_caps_negative_advantage_loss():
    ratio = np.array([[5.0, 2.5, 5.0, 0.5]], np.float32)
    advantage = np.array([[-1.0, -2.0, 1.0, -1.0]], np.float32)
    old = np.zeros_like(ratio)
    out = losses.ppo_clip_loss(f32(np.log(ratio)), f32(old), f32(advantage), clip_ratio_c=3.0)
    # 5 * 1 = 5 > 3 * 1: capped at 3. 2.5 * 2 = 5 < 3 * 2 = 6: not capped. A > 0 untouched: max(-5, -1.2).
    # ratio 0.5, A = -1: clip to 0.8 -> 0.8 < 3: not capped.
    np.testing.assert_allclose(np.asarray(out.loss)[0], [3.0, 5.0, -1.2, 0.8], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.dual_clipped)[0], [1, 0, 0, 0])
    no_dual = losses.ppo_clip_loss(f32(np.log(ratio)), f32(old), f32(advantage))
    np.testing.assert_allclose(np.asarray(no_dual.loss)[0], [5.0, 5.0, -1.2, 0.8], rtol=1e-5)
    # The capped token has no gradient (its loss is a constant in logp); the uncapped one does.
    grad = jax.grad(lambda lp: losses.ppo_clip_loss(lp, f32(old), f32(advantage), clip_ratio_c=3.0).loss.sum())(
        f32(np.log(ratio))
    )
    np.testing.assert_allclose(np.asarray(grad)[0], [0.0, 5.0, 0.0, 0.0], atol=1e-5)


def test_ppo_clip_matches_numpy_formula_on_random_inputs():
    rng = np.random.default_rng(2)
    logp = rng.normal(size=(4, 16)).astype(np.float32) * 0.5 - 2
    old = rng.normal(size=(4, 16)).astype(np.float32) * 0.5 - 2
    a = rng.normal(size=(4, 16)).astype(np.float32)
    r = np.exp(logp.astype(np.float64) - old)
    l1, l2 = -a * r, -a * np.clip(r, 0.9, 1.3)
    expected = np.maximum(l1, l2)
    expected = np.where(a < 0, np.minimum(expected, -a * 2.0), expected)
    out = losses.ppo_clip_loss(f32(logp), f32(old), f32(a), clip_low=0.1, clip_high=0.3, clip_ratio_c=2.0)
    np.testing.assert_allclose(np.asarray(out.loss), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.clipped), (l2 > l1).astype(np.float32))


def test_ppo_clip_rejects_bad_hyperparameters():
    x = f32([[0.0]])
    with pytest.raises(losses.LossConfigError, match="clip_ratio_c must be > 1"):
        losses.ppo_clip_loss(x, x, x, clip_ratio_c=0.9)
    with pytest.raises(losses.LossConfigError, match=">= 0"):
        losses.ppo_clip_loss(x, x, x, clip_low=-0.1)


def test_ppo_clip_huge_log_ratio_is_clamped_and_finite():
    out = losses.ppo_clip_loss(f32([[100.0]]), f32([[0.0]]), f32([[-1.0]]))
    assert float(out.log_ratio[0, 0]) == 20.0
    assert float(out.loss[0, 0]) == pytest.approx(math.exp(20.0), rel=1e-5)


# ------------------------------------------------------------------------------------------ KL


def test_kl_estimators_hand_computed():
    logp = f32([[-1.0, -2.0, -0.5]])
    ref = f32([[-1.5, -1.0, -0.5]])
    # d = logp - ref = (0.5, -1, 0)
    np.testing.assert_allclose(np.asarray(losses.kl_divergence("k1", logp, ref))[0], [0.5, -1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(np.asarray(losses.kl_divergence("k2", logp, ref))[0], [0.125, 0.5, 0.0], atol=1e-6)
    # k3 = exp(-d) + d - 1
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1, 0.0]
    np.testing.assert_allclose(np.asarray(losses.kl_divergence("k3", logp, ref))[0], k3, rtol=1e-5, atol=1e-7)


def test_k3_is_clamped_to_ten_with_finite_gradient():
    logp = f32([[0.0, -30.0, 0.0, -2.0]])
    ref = f32([[-30.0, 0.0, -300.0, 1.0]])
    # ref - logp = -30: exp(-30) + 30 - 1 = 29 -> 10; +30: e^30 -> 10; -300 -> 10; +3: e^3 - 4 = 16.09 -> 10
    k3 = losses.kl_k3(logp, ref)
    np.testing.assert_allclose(np.asarray(k3)[0], [10.0, 10.0, 10.0, 10.0])
    inside = losses.kl_k3(f32([[-2.0]]), f32([[0.0]]))
    assert float(inside[0, 0]) == pytest.approx(math.exp(2.0) - 3.0, rel=1e-6)  # 4.389, not clamped
    grad = jax.grad(lambda lp: losses.kl_k3(lp, ref).sum())(logp)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)  # clamped region: no gradient, and no NaN


def test_k3_gradient_inside_range_is_one_minus_exp():
    logp, ref = f32([[-1.0]]), f32([[-1.5]])
    grad = jax.grad(lambda lp: losses.kl_k3(lp, ref).sum())(logp)
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    assert float(grad[0, 0]) == pytest.approx(1 - math.exp(-0.5), rel=1e-5)


def test_unknown_kl_lists_valid_names():
    with pytest.raises(losses.LossConfigError, match="valid names: k1, k2, k3"):
        losses.kl_divergence("low_var_kl", f32([[0.0]]), f32([[0.0]]))


# ------------------------------------------------------------------------------------------ entropy and log-probs


def test_entropy_hand_computed():
    logits = f32([[[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0], [0.0, -jnp.inf, math.log(3.0), -jnp.inf]]])
    h = np.asarray(losses.entropy_from_logits(logits))[0]
    # uniform over 4: log 4; a near one-hot: 0; probabilities (1/4, 3/4): -(1/4 ln 1/4 + 3/4 ln 3/4)
    np.testing.assert_allclose(h, [math.log(4.0), 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))], atol=1e-6)
    grad = jax.grad(lambda z: losses.entropy_from_logits(z).sum())(logits)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_entropy_and_logprobs_match_numpy_and_bf16_is_upcast():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32) * 3
    targets = rng.integers(0, 7, size=(2, 3))
    z = logits.astype(np.float64)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    np.testing.assert_allclose(
        np.asarray(losses.entropy_from_logits(f32(logits))), -(np.exp(logsm) * logsm).sum(-1), rtol=1e-5, atol=1e-6
    )
    picked = np.take_along_axis(logsm, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(
        np.asarray(losses.logprobs_from_logits(f32(logits), jnp.asarray(targets))), picked, rtol=1e-5
    )
    assert losses.entropy_from_logits(f32(logits).astype(jnp.bfloat16)).dtype == jnp.float32


def test_fused_logprobs_and_entropy_equal_the_two_functions_in_value_and_gradient():
    """One pass over the vocabulary (custom backward) against the composed reference, with a banned (-inf) entry
    in every row, a peaked row and a bf16 input; the gradient weights both outputs differently."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, 4, 9)).astype(np.float32) * 3
    logits[..., 2] = -np.inf
    logits[0, 1, 5] = 80.0
    targets = jnp.asarray(rng.integers(3, 9, size=(3, 4)), jnp.int32)
    w_logp, w_entropy = f32(rng.normal(size=(3, 4))), f32(rng.normal(size=(3, 4)))

    def fused(z):
        return losses.logprobs_and_entropy(z, targets)

    def composed(z):
        return losses.logprobs_from_logits(z, targets), losses.entropy_from_logits(z)

    for z in (f32(logits), f32(logits).astype(jnp.bfloat16)):
        for got, want in zip(jax.jit(fused)(z), composed(z)):
            assert got.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    grads = [jax.grad(lambda z, fn=fn: jnp.sum(fn(z)[0] * w_logp) + jnp.sum(fn(z)[1] * w_entropy))(f32(logits))
             for fn in (fused, composed)]
    assert np.all(np.isfinite(np.asarray(grads[0])))
    assert np.all(np.asarray(grads[0])[..., 2] == 0.0)  # a banned token gets no gradient
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-5, atol=1e-6)


def test_chunked_logprobs_and_entropy_equal_full_logits_in_value_and_gradient():
    rng = np.random.default_rng(4)
    hidden = f32(rng.normal(size=(2, 12, 8)))
    head = f32(rng.normal(size=(8, 10)) * 0.3)
    targets = jnp.asarray(rng.integers(0, 10, size=(2, 12)), jnp.int32)

    def full(h, w):
        z = jnp.einsum("btd,dv->btv", h, w)
        return losses.logprobs_from_logits(z, targets), losses.entropy_from_logits(z)

    chunked = jax.jit(functools.partial(losses.chunked_logprobs_and_entropy, targets=targets, chunk_size=4))
    for got, want in zip(chunked(hidden, head), full(hidden, head)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    def scalar(fn):
        def value(h, w):
            lp, ent = fn(h, w)
            return jnp.sum(lp * 0.3) + jnp.sum(ent * 0.1)
        return value

    g_chunk = jax.grad(scalar(lambda h, w: losses.chunked_logprobs_and_entropy(h, w, targets, 3)), argnums=(0, 1))(
        hidden, head
    )
    g_full = jax.grad(scalar(full), argnums=(0, 1))(hidden, head)
    for a, b in zip(g_chunk, g_full):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    with pytest.raises(losses.LossConfigError, match="positive divisor of the sequence length 12"):
        losses.chunked_logprobs_and_entropy(hidden, head, targets, 5)


# ------------------------------------------------------------------------------------------ value loss


def test_clipped_value_loss_hand_computed():
    values = f32([[1.0, 0.0, 2.0, 0.5]])
    old = f32([[0.0, 0.0, 0.0, 0.4]])
    returns = f32([[1.0, 3.0, -1.0, 0.5]])
    loss, clipped = losses.clipped_value_loss(values, old, returns, clip_range=0.5)
    # t0: V=1 clipped to 0.5: max(0, 0.25) -> 0.125; t1: V=0 in range: 4.5; t2: V=2 -> 0.5: max(9, 2.25) -> 4.5;
    # t3: V=0.5 in range (0.4 +- 0.5): 0
    np.testing.assert_allclose(np.asarray(loss)[0], [0.125, 4.5, 4.5, 0.0], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(clipped)[0], [1, 0, 0, 0])
    plain, _ = losses.clipped_value_loss(values, old, returns, clip_range=None)
    np.testing.assert_allclose(np.asarray(plain)[0], [0.0, 4.5, 4.5, 0.0], atol=1e-6)
    with pytest.raises(losses.LossConfigError, match="clip_range"):
        losses.clipped_value_loss(values, old, returns, clip_range=-1.0)


# ------------------------------------------------------------------------------------------ jit


def test_every_loss_jits():
    rng = np.random.default_rng(5)
    x = lambda: f32(rng.normal(size=(3, 9)))  # noqa: E731
    mask = f32([TWO_TURNS, [1] * 9, [0] * 9])
    logits = f32(rng.normal(size=(3, 9, 6)))
    targets = jnp.zeros((3, 9), jnp.int32)

    @jax.jit
    def everything(logp, old, ref, a, v, v_old, r):
        pg = losses.ppo_clip_loss(logp, old, a, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
        out = {mode: losses.aggregate_loss(mode, pg.loss, mask) for mode in losses.LOSS_AGGREGATIONS}
        out.update({name: losses.kl_divergence(name, logp, ref) for name in losses.KL_ESTIMATORS})
        out["entropy"] = losses.entropy_from_logits(logits)
        out["logp"] = losses.logprobs_from_logits(logits, targets)
        out["value"] = losses.clipped_value_loss(v, v_old, r)
        out["clipfrac"] = losses.masked_token_mean(pg.clipped, mask)
        return out

    out = everything(*(x() for _ in range(7)))
    for leaf in jax.tree_util.tree_leaves(out):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert 0.0 <= float(out["clipfrac"]) <= 1.0
