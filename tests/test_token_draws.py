"""The sampler's per-row token draw follows softmax(logits) and never picks a zero-probability token."""

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.sampling import _inverse_cdf_sample


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
