"""Advantage estimators against hand-computed numbers and independent numpy loops."""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import advantages as adv

# Two agent turns separated by an environment observation, then one masked trailing env token.
TWO_TURNS = [0, 0, 1, 1, 0, 0, 1, 1, 0]


def f32(x) -> jnp.ndarray:
    return jnp.asarray(np.asarray(x, np.float32))


# ------------------------------------------------------------------------------------------ numpy references


def np_whiten(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    sel = x[mask > 0].astype(np.float64)
    out = (x - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)
    return np.where(mask > 0, out, 0.0)


def np_agent_returns(rewards: np.ndarray, mask: np.ndarray, gamma: float) -> np.ndarray:
    out = np.zeros_like(rewards, dtype=np.float64)
    for b in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t] > 0:
                running = rewards[b, t] + gamma * running
                out[b, t] = running
    return out


def np_gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    out = np.zeros_like(rewards, dtype=np.float64)
    for b in range(rewards.shape[0]):
        next_value, running = 0.0, 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t] > 0:
                delta = rewards[b, t] + gamma * next_value - values[b, t]
                running = delta + gamma * lam * running
                out[b, t] = running
                next_value = values[b, t]
    return out


def np_last_agent_rewards(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    out = np.zeros(mask.shape, np.float64)
    for b in range(mask.shape[0]):
        idx = np.nonzero(mask[b] > 0)[0]
        if idx.size:
            out[b, idx[-1]] = scores[b]
    return out


# ------------------------------------------------------------------------------------------ masked statistics


def test_masked_mean_var_whiten_match_numpy_on_selected_entries():
    x = np.array([[1.0, 9.0, 2.0], [4.0, np.nan, 7.0]], np.float32)
    mask = np.array([[1, 0, 1], [1, 0, 1]], np.float32)
    sel = np.array([1.0, 2.0, 4.0, 7.0])
    assert float(adv.masked_mean(f32(x), f32(mask))) == pytest.approx(3.5)
    assert float(adv.masked_var(f32(x), f32(mask))) == pytest.approx(sel.var(ddof=1))  # 7.0
    assert float(adv.masked_var(f32(x), f32(mask), unbiased=False)) == pytest.approx(sel.var())
    np.testing.assert_allclose(adv.masked_whiten(f32(x), f32(mask)), np_whiten(np.nan_to_num(x), mask), atol=1e-6)
    np.testing.assert_allclose(adv.masked_mean(f32(x), f32(mask), axis=-1), [1.5, 5.5])


def test_masked_stats_of_empty_mask_are_zero_not_nan():
    x = f32([[1.0, 2.0]])
    empty = f32([[0.0, 0.0]])
    assert float(adv.masked_mean(x, empty)) == 0.0
    assert float(adv.masked_var(x, empty)) == 0.0
    np.testing.assert_array_equal(adv.masked_whiten(x, empty), [[0.0, 0.0]])
    # A single token has no unbiased variance: the whitened value is 0, not NaN.
    np.testing.assert_array_equal(adv.masked_whiten(x, f32([[1.0, 0.0]])), [[0.0, 0.0]])


def test_masked_whiten_without_mean_shift_keeps_the_mean():
    x = np.array([[1.0, 3.0, 5.0, 100.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], np.float32)
    out = np.asarray(adv.masked_whiten(f32(x), f32(mask), shift_mean=False))
    # mean 3, unbiased var 4 -> (x - 3) / 2 + 3
    np.testing.assert_allclose(out, [[2.0, 3.0, 4.0, 0.0]], atol=1e-5)


# ------------------------------------------------------------------------------------------ reward placement


def test_outcome_reward_sits_on_last_agent_token_not_last_real_token():
    mask = f32([TWO_TURNS, [1, 1, 0, 0, 0, 0, 0, 0, 0], [0] * 9])
    rewards = np.asarray(adv.outcome_token_rewards(f32([2.0, -1.0, 5.0]), mask))
    expected = np.zeros((3, 9))
    expected[0, 7] = 2.0  # position 8 is the env token after the last turn
    expected[1, 1] = -1.0
    np.testing.assert_array_equal(rewards, expected)  # the padding row gets nothing


# ------------------------------------------------------------------------------------------ GRPO


def grpo_batch():
    mask = np.array(
        [
            TWO_TURNS,
            [0, 1, 1, 1, 0, 0, 0, 0, 0],
            [0, 0, 0, 1, 0, 1, 1, 1, 1],
            TWO_TURNS,
            [1, 0, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0, 1, 0, 0],
            [0] * 9,  # padding row sharing group 1001's id, with a wild score: must be ignored
        ],
        np.float32,
    )
    scores = np.array([1.0, 0.0, 0.5, 1.0, 0.0, 0.7, 100.0], np.float32)
    group_ids = np.array([1001, 1001, 1001, 5, 5, -3, 1001], np.int32)
    return scores, mask, group_ids


def test_grpo_hand_computed_groups_of_size_three_two_and_one():
    scores, mask, group_ids = grpo_batch()
    a, r = adv.compute_advantages("grpo", scores=f32(scores), loss_mask=f32(mask), group_ids=jnp.asarray(group_ids))
    a = np.asarray(a)
    eps = 1e-6
    # group 1001: scores (1, 0, 0.5): mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
    # group 5: scores (1, 0): mean 0.5, std sqrt(0.5)
    # group -3: a single trajectory: mean 0, std 1
    per_row = [0.5 / (0.5 + eps), -0.5 / (0.5 + eps), 0.0, 0.5 / (math.sqrt(0.5) + eps),
               -0.5 / (math.sqrt(0.5) + eps), 0.7 / (1 + eps), 0.0]
    np.testing.assert_allclose(a, np.array(per_row)[:, None] * mask, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(a, np.asarray(r))


def test_dr_grpo_skips_std_division():
    scores, mask, group_ids = grpo_batch()
    a, _ = adv.compute_advantages(
        "grpo", scores=f32(scores), loss_mask=f32(mask), group_ids=jnp.asarray(group_ids), normalize_std=False
    )
    per_row = [0.5, -0.5, 0.0, 0.5, -0.5, 0.7, 0.0]
    np.testing.assert_allclose(np.asarray(a), np.array(per_row)[:, None] * mask, atol=1e-6)


def test_grpo_matches_numpy_loop_on_random_groups():
    rng = np.random.default_rng(0)
    batch, length = 12, 7
    group_ids = rng.integers(0, 4, size=batch).astype(np.int32) * 17
    scores = rng.normal(size=batch).astype(np.float32)
    mask = (rng.random((batch, length)) < 0.6).astype(np.float32)
    mask[:, 0] = 1.0
    expected = np.zeros(batch)
    for i in range(batch):
        members = scores[group_ids == group_ids[i]].astype(np.float64)
        mean, std = (members.mean(), members.std(ddof=1)) if members.size > 1 else (0.0, 1.0)
        expected[i] = (scores[i] - mean) / (std + 1e-6)
    a, _ = adv.grpo_advantages(scores=f32(scores), loss_mask=f32(mask), group_ids=jnp.asarray(group_ids))
    np.testing.assert_allclose(np.asarray(a), expected[:, None] * mask, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ RLOO


def test_rloo_leave_one_out_hand_computed():
    scores, mask, group_ids = grpo_batch()
    keep = group_ids != -3  # RLOO needs groups of >= 2
    scores, mask, group_ids = scores[keep], mask[keep], group_ids[keep]
    a, r = adv.compute_advantages("rloo", scores=f32(scores), loss_mask=f32(mask), group_ids=jnp.asarray(group_ids))
    # group 1001 (1, 0, 0.5): 1 - 0.25, 0 - 0.75, 0.5 - 0.5; group 5 (1, 0): 1 - 0, 0 - 1; padding row: 0
    per_row = [0.75, -0.75, 0.0, 1.0, -1.0, 0.0]
    np.testing.assert_allclose(np.asarray(a), np.array(per_row)[:, None] * mask, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    # The same as the scaled form s * N/(N-1) - mean * N/(N-1) for group 1001 (N = 3, mean 0.5).
    assert per_row[0] == pytest.approx(1.0 * 1.5 - 0.5 * 1.5)


def test_check_group_sizes_names_small_groups_and_ignores_padding_rows():
    scores, mask, group_ids = grpo_batch()
    with pytest.raises(adv.AdvantageError, match=r"fewer than 2 .*-3: 1.*rollout n >= 2"):
        adv.check_group_sizes(group_ids, 2, mask)
    # The padding row (all-zero mask) is not counted: group 1001 has 3 members, not 4.
    with pytest.raises(adv.AdvantageError, match="1001: 3"):
        adv.check_group_sizes(group_ids, 4, mask)
    with pytest.raises(adv.AdvantageError, match="1001: 4"):
        adv.check_group_sizes(group_ids, 5, None)
    keep = group_ids != -3
    adv.check_group_sizes(group_ids[keep], 2, mask[keep])
    with pytest.raises(adv.AdvantageError, match="5: 2"):
        adv.check_group_sizes(group_ids[keep], 3, mask[keep])
    with pytest.raises(adv.AdvantageError, match="fewer than 2"):
        adv.check_estimator_inputs("rloo", group_ids, mask)
    adv.check_estimator_inputs("grpo", group_ids, mask)


def test_empty_loss_mask_is_rejected_on_the_host():
    with pytest.raises(adv.AdvantageError, match="all zero"):
        adv.check_estimator_inputs("grpo", np.zeros(2, np.int32), np.zeros((2, 4), np.float32))


# ------------------------------------------------------------------------------------------ REINFORCE++


def test_reinforce_pp_discounts_over_agent_tokens_only():
    mask = np.array([TWO_TURNS, [0, 1, 1, 0, 0, 0, 0, 0, 0], [0] * 9], np.float32)
    scores = np.array([1.0, -2.0, 3.0], np.float32)
    a, returns = adv.compute_advantages(
        "reinforce_pp", scores=f32(scores), loss_mask=f32(mask), gamma=0.5, reward_kl_coef=0.0
    )
    expected_returns = np.zeros((3, 9))
    # row 0: agent tokens at 2, 3, 6, 7; the env tokens 4, 5 do not discount: 1, 0.5, 0.25, 0.125
    expected_returns[0, [7, 6, 3, 2]] = [1.0, 0.5, 0.25, 0.125]
    expected_returns[1, [2, 1]] = [-2.0, -1.0]
    np.testing.assert_allclose(np.asarray(returns), expected_returns, atol=1e-7)
    sel = np.array([0.125, 0.25, 0.5, 1.0, -1.0, -2.0])
    whitened = (expected_returns - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8) * mask
    np.testing.assert_allclose(np.asarray(a), whitened, rtol=1e-5, atol=1e-6)


def test_reinforce_pp_with_k1_penalty_matches_numpy_loop():
    rng = np.random.default_rng(1)
    mask = np.array([TWO_TURNS, [1, 1, 0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0, 0]], np.float32)
    scores = np.array([1.0, 0.0, 0.5], np.float32)
    old_logp = rng.normal(size=mask.shape).astype(np.float32) - 1
    ref_logp = rng.normal(size=mask.shape).astype(np.float32) - 1
    old_logp[mask == 0] = np.nan  # never read off the mask
    kl_coef, gamma = 0.1, 0.9
    rewards = np_last_agent_rewards(scores, mask) - kl_coef * np.where(mask > 0, old_logp - ref_logp, 0.0)
    expected_returns = np_agent_returns(rewards, mask, gamma)
    a, returns = adv.reinforce_pp_advantages(
        scores=f32(scores), loss_mask=f32(mask), old_logp=f32(old_logp), ref_logp=f32(ref_logp),
        gamma=gamma, reward_kl_coef=kl_coef,
    )
    np.testing.assert_allclose(np.asarray(returns), expected_returns, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a), np_whiten(expected_returns, mask), rtol=1e-4, atol=1e-5)


def test_reinforce_pp_needs_logprobs_when_penalized():
    with pytest.raises(adv.AdvantageError, match="old_logp and ref_logp"):
        adv.compute_advantages("reinforce_pp", scores=f32([1.0]), loss_mask=f32([[1.0]]), reward_kl_coef=0.01)


# ------------------------------------------------------------------------------------------ GAE


def test_gae_hand_computed_with_env_tokens_between_turns():
    mask = np.array([TWO_TURNS], np.float32)
    values = np.full((1, 9), 1.0, np.float32)
    values[0, [0, 1, 4, 5, 8]] = np.nan  # critic outputs off the mask must not be read
    a, returns = adv.compute_advantages(
        "gae", scores=f32([1.0]), loss_mask=f32(mask), values=f32(values), gamma=0.9, lam=0.8, whiten_advantages=False
    )
    # t=7: delta = 1 + 0.9*0 - 1 = 0                      -> A = 0
    # t=6: delta = 0 + 0.9*1 - 1 = -0.1                   -> A = -0.1
    # t=3: delta = -0.1 (next value is V_6, across env)   -> A = -0.1 + 0.72*(-0.1) = -0.172
    # t=2: delta = -0.1                                   -> A = -0.1 + 0.72*(-0.172) = -0.22384
    expected = np.zeros((1, 9))
    expected[0, [2, 3, 6, 7]] = [-0.22384, -0.172, -0.1, 0.0]
    np.testing.assert_allclose(np.asarray(a), expected, atol=1e-6)
    np.testing.assert_allclose(np.asarray(returns), (expected + 1.0) * mask, atol=1e-6)


def test_gae_matches_numpy_loop_and_whitens_over_mask():
    rng = np.random.default_rng(2)
    mask = np.array(
        [TWO_TURNS, [0, 1, 1, 0, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0, 0], [0] * 9], np.float32
    )
    scores = np.array([1.0, 0.0, -0.5, 7.0], np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    old_logp = rng.normal(size=mask.shape).astype(np.float32)
    ref_logp = rng.normal(size=mask.shape).astype(np.float32)
    gamma, lam, kl_coef = 0.95, 0.9, 0.05
    rewards = np_last_agent_rewards(scores, mask) - kl_coef * (old_logp - ref_logp) * mask
    raw = np_gae(rewards, values, mask, gamma, lam)
    a, returns = adv.gae_advantages(
        scores=f32(scores), loss_mask=f32(mask), values=f32(values), old_logp=f32(old_logp),
        ref_logp=f32(ref_logp), gamma=gamma, lam=lam, reward_kl_coef=kl_coef,
    )
    np.testing.assert_allclose(np.asarray(returns), (raw + values) * mask, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(a), np_whiten(raw, mask), rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(a)[3] == 0.0)


@pytest.mark.parametrize("name", ["gae", "reinforce_pp"])
def test_outcome_only_reward_gives_nonzero_agent_advantages(name):
    """The original put the reward on a masked env token, so these estimators saw 0 reward and 0 advantage."""
    mask = np.array([TWO_TURNS, [0, 1, 1, 0, 0, 0, 1, 0, 0]], np.float32)
    fields = dict(scores=f32([1.0, 0.0]), loss_mask=f32(mask))
    if name == "gae":
        fields["values"] = jnp.zeros(mask.shape)
    raw = dict(whiten_advantages=False) if name == "gae" else dict(reward_kl_coef=0.0)
    a, returns = adv.compute_advantages(name, gamma=1.0, **fields, **raw)
    a, returns = np.asarray(a), np.asarray(returns)
    # With gamma = 1 (lambda = 1), zero values and no KL, every agent token of row 0 gets the full outcome 1.
    np.testing.assert_allclose(a[0] if name == "gae" else returns[0], mask[0], atol=1e-7)
    np.testing.assert_allclose(returns[0], mask[0], atol=1e-7)
    np.testing.assert_array_equal(returns[1], np.zeros(9))
    assert np.all(a[0][mask[0] > 0] != 0.0)
    if name == "reinforce_pp":  # whitened: the rewarded row is above the mean, the unrewarded one below
        assert np.all(a[0][mask[0] > 0] > 0) and np.all(a[1][mask[1] > 0] < 0)


# ------------------------------------------------------------------------------------------ registry and jit


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(adv.AdvantageError, match="valid names: gae, gigpo, grpo, reinforce_pp, rloo"):
        adv.get_estimator("ppo")


def test_missing_field_and_unknown_option_are_named():
    with pytest.raises(adv.AdvantageError, match=r"needs batch field\(s\) \['values'\]"):
        adv.compute_advantages("gae", scores=f32([1.0]), loss_mask=f32([[1.0]]))
    with pytest.raises(adv.AdvantageError, match=r"does not accept \['lambda'\]"):
        adv.compute_advantages("gae", scores=f32([1.0]), loss_mask=f32([[1.0]]), values=f32([[0.0]]), **{"lambda": 0.9})


def test_every_estimator_jits_and_matches_eager():
    scores, mask, group_ids = grpo_batch()
    keep = group_ids != -3
    rng = np.random.default_rng(3)
    batch = dict(
        scores=f32(scores[keep]), loss_mask=f32(mask[keep]), group_ids=jnp.asarray(group_ids[keep]),
        values=f32(rng.normal(size=mask[keep].shape)), old_logp=f32(rng.normal(size=mask[keep].shape)),
        ref_logp=f32(rng.normal(size=mask[keep].shape)),
        # one turn per agent token run, states 0/1 so some step groups repeat
        turn_ids=jnp.asarray(np.where(mask[keep] > 0, np.cumsum(np.diff(mask[keep], prepend=0, axis=1) > 0,
                                                                   axis=1) - 1, -1), jnp.int32),
        step_rewards=f32(rng.normal(size=(int(keep.sum()), mask.shape[1]))),
        step_states=jnp.asarray(rng.integers(0, 2, size=(int(keep.sum()), mask.shape[1])), jnp.int32),
    )
    for name in adv.estimator_names():
        est = adv.get_estimator(name)
        fields = {k: v for k, v in batch.items() if k in est.requires or k in inspect.signature(est.fn).parameters}
        fn = functools.partial(adv.compute_advantages, name)
        eager = est.fn(**fields)
        jitted = jax.jit(fn)(**batch)  # the whole batch: unused fields are dropped
        for e, j in zip(eager, jitted):
            assert j.shape == mask[keep].shape
            assert np.all(np.isfinite(np.asarray(j)))
            np.testing.assert_allclose(np.asarray(j), np.asarray(e), rtol=1e-6, atol=1e-6)


def test_advantage_stats_are_masked():
    a = f32([[1.0, 50.0, 3.0]])
    r = f32([[2.0, -50.0, 2.0]])
    stats = adv.advantage_stats(a, r, f32([[1, 0, 1]]))
    assert float(stats["advantages/mean"]) == pytest.approx(2.0)
    assert float(stats["advantages/std"]) == pytest.approx(1.0)
    assert float(stats["advantages/max"]) == 3.0
    assert float(stats["returns/min"]) == 2.0
