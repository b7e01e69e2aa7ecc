"""The sampler's per-row token draw follows softmax(logits) and never picks a zero-probability token; top-k and
top-p keep the sets a sort would."""

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.token_draws import inverse_cdf_sample as _inverse_cdf_sample, top_k_top_p_mask


def test_inverse_cdf_draws_match_the_distribution():
    logits = jnp.log(jnp.asarray([0.5, 0.3, 0.0, 0.15, 0.05]))  # token 2 has probability 0 (-inf logit)
    rows = 20000
    keys = jax.random.split(jax.random.PRNGKey(3), rows)
    draws = np.asarray(_inverse_cdf_sample(keys, jnp.broadcast_to(logits, (rows, 5))))
    counts = np.bincount(draws, minlength=5) / rows
    assert counts[2] == 0.0
    # 4.5 standard errors of a binomial proportion at n = 20000 is under 0.016
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.0, 0.15, 0.05], atol=0.016)
    assert draws.min() >= 0 and draws.max() <= 4


def test_inverse_cdf_draws_are_a_function_of_the_row_key():
    logits = jax.random.normal(jax.random.PRNGKey(0), (6, 40))
    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    first, again = _inverse_cdf_sample(keys, logits), _inverse_cdf_sample(keys, logits)
    np.testing.assert_array_equal(first, again)
    other = _inverse_cdf_sample(jax.random.split(jax.random.PRNGKey(2), 6), logits)
    assert not np.array_equal(first, other)


def _sorted_mask(logits: np.ndarray, k: int, p: float) -> np.ndarray:
    """The reference: sort, keep the first k, renormalize, keep while the mass before a token is below p."""
    order = np.argsort(-logits, kind="stable")
    ranked = logits[order]
    keep = np.arange(len(ranked)) < (k or len(ranked))
    probs = np.exp(np.where(keep, ranked - ranked.max(), -np.inf))
    probs /= probs.sum()
    keep &= ((np.cumsum(probs) - probs) < p) | (p >= 1.0)
    mask = np.zeros(len(ranked), bool)
    mask[order[keep]] = True
    return mask


def test_top_k_top_p_mask_equals_the_sorted_reference():
    rs = np.random.RandomState(0)
    logits = (rs.randn(64, 500) * rs.uniform(0.5, 6, (64, 1))).astype(np.float32)
    logits[:4, :250] = -np.inf  # rows whose lower half is already masked out
    top_k = rs.choice([0, 1, 5, 40, 499], 64).astype(np.int32)
    top_p = rs.choice([1.0, 0.95, 0.5, 0.1, 1e-4], 64).astype(np.float32)
    mask = np.asarray(top_k_top_p_mask(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    for row in range(64):
        expected = _sorted_mask(logits[row], int(top_k[row]), float(top_p[row]))
        np.testing.assert_array_equal(mask[row], expected, err_msg=f"row {row}: k={top_k[row]} p={top_p[row]}")
    assert mask.sum(axis=1).min() >= 1 and (mask.sum(axis=1) < 500).sum() > 50  # every row draws; most filter


def test_tokens_tied_at_the_boundary_are_kept_together():
    logits = jnp.asarray([[3.0, 1.0, 2.0, 2.0, 0.5]])
    mask = top_k_top_p_mask(logits, jnp.asarray([2]), jnp.asarray([1.0]))
    assert np.asarray(mask)[0].tolist() == [True, False, True, True, False]  # k = 2, but tokens 2 and 3 tie
    # negative and positive logits, and a row of one finite logit
    logits = jnp.asarray([[-1.0, -0.5, 0.0, 0.25, -jnp.inf], [-jnp.inf, -jnp.inf, 4.0, -jnp.inf, -jnp.inf]])
    mask = np.asarray(top_k_top_p_mask(logits, jnp.asarray([3, 0]), jnp.asarray([1.0, 0.3])))
    assert mask.tolist() == [[False, True, True, True, False], [False, False, True, False, False]]


def test_first_argmax_equals_argmax_with_ties():
    from agentgym_jax.token_draws import first_argmax

    logits = np.random.RandomState(0).randn(6, 50).astype(np.float32)
    logits[1, [7, 30]] = 9.0  # a tie: the first index wins, as in argmax
    logits[2] = -1.0  # all tied
    logits[3, -1] = 9.0  # the last index
    got = np.asarray(first_argmax(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, -1))
    assert got[1] == 7 and got[2] == 0 and got[3] == 49


def test_draw_tokens_per_row_do_not_depend_on_the_other_rows_kind():
    """Greedy rows and drawn rows give the same tokens and log-probs in a mixed batch as in batches of their own
    kind (where one of the two picks is skipped)."""
    from agentgym_jax.token_draws import draw_tokens

    rows, vocab = 4, 40
    logits = jnp.asarray(np.random.RandomState(1).randn(rows, vocab).astype(np.float32) * 3)
    keys = jax.random.split(jax.random.PRNGKey(5), rows)
    counters = jnp.arange(rows, dtype=jnp.int32)
    top_p, top_k = jnp.full((rows,), 0.9), jnp.full((rows,), 5, jnp.int32)

    def draw(temperature):
        return jax.jit(draw_tokens, static_argnames=("filtered",))(
            logits, keys, counters, jnp.asarray(temperature, jnp.float32), top_p, top_k, filtered=True)

    mixed_tokens, mixed_logprobs = draw([0.0, 1.0, 0.0, 1.0])
    greedy_tokens, greedy_logprobs = draw([0.0] * rows)
    drawn_tokens, drawn_logprobs = draw([1.0] * rows)
    np.testing.assert_array_equal(np.asarray(greedy_tokens), np.argmax(np.asarray(logits), -1))
    expected = np.where([True, False, True, False], greedy_tokens, drawn_tokens)
    np.testing.assert_array_equal(np.asarray(mixed_tokens), expected)
    np.testing.assert_array_equal(np.asarray(mixed_logprobs),
                                  np.where([True, False, True, False], greedy_logprobs, drawn_logprobs))
    log_softmax = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(np.asarray(drawn_logprobs), log_softmax[np.arange(rows), np.asarray(drawn_tokens)],
                               rtol=1e-6)
    # a drawn row keeps to its top 5 tokens
    top5 = np.argsort(-np.asarray(logits), -1)[:, :5]
    assert all(int(t) in top5[r] for r, t in enumerate(np.asarray(drawn_tokens)))
