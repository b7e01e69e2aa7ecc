"""A user's own advantage estimator, registered from outside the package (tests/test_algorithms.py trains with it
through `launch.train --config.algo.import_modules=tests.toy_estimator`)."""

import jax.numpy as jnp

from agentgym_jax.advantages import register_estimator


@register_estimator("toy_constant", requires=("scores", "loss_mask"))
def toy_constant_advantages(*, scores, loss_mask, level: float = 0.5):
    """Every agent token gets advantage ``level``, whatever the reward (a test double, not an algorithm)."""
    advantages = jnp.where(loss_mask > 0, level, 0.0).astype(jnp.float32)
    return advantages, advantages
