"""Advantage estimators for multi-turn agent RL, as pure, jit-compatible jax.numpy functions.

The trajectory batch is ``[B, T]``, right-padded, one row per trajectory:

* ``loss_mask`` float ``[B, T]``: 1 on the agent's own sampled tokens (and its end-of-turn token), 0 on the
  system prompt, environment observations, chat-template glue and padding.
* ``scores`` float ``[B]``: one outcome reward per trajectory. Where a per-token reward is needed it sits on
  the **last token with loss_mask == 1** of the row (never on a masked environment token, where it would be
  multiplied away).
* ``group_ids`` int ``[B]``: trajectories sampled for the same task share an id (any int values).
* ``values``, ``old_logp``, ``ref_logp`` float ``[B, T]``: only read where ``loss_mask == 1``; whatever sits
  at masked positions (even NaN) never reaches the result.

Rows whose loss mask is all zero (padding rows, e.g. added to fill a device multiple) get zero advantages and
are left out of every group and batch statistic.

Every estimator returns ``(advantages, returns)``, both ``[B, T]`` float32 and zero outside the mask. Pick one
by name with :func:`get_estimator` or call :func:`compute_advantages`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.registry import Entry, Registry

Array = jax.Array
# Batch fields an estimator may require (the rest of its parameters are options; see agentgym_jax/registry.py).
# turn_ids [B, T]: each agent token's turn (-1 elsewhere); step_rewards / step_states [B, S]: per turn, the
# reward it earned and an id of the environment state it acted in (-1 past the row's last turn).
BATCH_FIELDS = ("scores", "loss_mask", "group_ids", "values", "old_logp", "ref_logp", "turn_ids", "step_rewards",
                "step_states")
ESTIMATORS: Registry = Registry("advantage estimator", inputs=BATCH_FIELDS)
register_estimator = ESTIMATORS.register

WHITEN_EPS = 1e-8
GRPO_EPS = 1e-6


class AdvantageError(ValueError):
    """Raised for an unknown estimator, a missing batch field, a bad option or too-small groups."""


# --------------------------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------------------------


def _is_on(loss_mask: Array) -> Array:
    return loss_mask > 0


def masked_mean(x: Array, mask: Array, axis: int | None = None) -> Array:
    """Mean of ``x`` over positions where ``mask > 0`` (0 where the mask is empty). NaN-safe off the mask."""
    on = _is_on(mask)
    total = jnp.sum(jnp.where(on, x, 0.0), axis=axis)
    count = jnp.sum(on, axis=axis)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


def masked_var(x: Array, mask: Array, unbiased: bool = True) -> Array:
    """Variance of ``x`` over the whole mask; ``unbiased`` applies Bessel's n/(n-1) (0 when n <= 1)."""
    on = _is_on(mask)
    mean = masked_mean(x, mask)
    centered = jnp.where(on, x - mean, 0.0)
    count = jnp.sum(on)
    ddof = 1 if unbiased else 0
    return jnp.where(count > ddof, jnp.sum(centered**2) / jnp.maximum(count - ddof, 1), 0.0)


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True) -> Array:
    """``(x - mean) / sqrt(var + 1e-8)`` with mask statistics (unbiased var); zero outside the mask.

    With ``shift_mean=False`` the mean is added back after scaling (only the scale is normalized).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * jax.lax.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(_is_on(mask), whitened, 0.0)


# --------------------------------------------------------------------------------------------------------------
# Per-row helpers
# --------------------------------------------------------------------------------------------------------------


def row_has_tokens(loss_mask: Array) -> Array:
    """``[B]`` bool: whether the row has at least one agent (loss-masked) token."""
    return jnp.any(_is_on(loss_mask), axis=-1)


def last_agent_token_onehot(loss_mask: Array) -> Array:
    """``[B, T]`` float32 one-hot of the last position with ``loss_mask > 0`` in each row (all zero if none)."""
    on = _is_on(loss_mask)
    num_tokens = loss_mask.shape[-1]
    last = num_tokens - 1 - jnp.argmax(on[:, ::-1], axis=-1)
    onehot = jax.nn.one_hot(last, num_tokens, dtype=jnp.float32)
    return onehot * row_has_tokens(loss_mask)[:, None]


def outcome_token_rewards(scores: Array, loss_mask: Array) -> Array:
    """``[B, T]`` token rewards holding each row's score on its last agent token and 0 elsewhere."""
    return last_agent_token_onehot(loss_mask) * scores.astype(jnp.float32)[:, None]


def k1_reward_penalty(old_logp: Array, ref_logp: Array, loss_mask: Array, kl_coef: float) -> Array:
    """``-kl_coef * (old_logp - ref_logp)`` on agent tokens, 0 elsewhere (the k1 KL used as a reward penalty)."""
    on = _is_on(loss_mask)
    kl = jnp.where(on, old_logp, 0.0) - jnp.where(on, ref_logp, 0.0)
    return jnp.where(on, -kl_coef * kl, 0.0).astype(jnp.float32)


def overlong_penalty(agent_tokens: np.ndarray, max_tokens: int, buffer: int, penalty: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment per trajectory: 0 up to ``max_tokens - buffer`` agent tokens, then growing
    linearly to ``penalty`` at ``max_tokens`` (and staying there beyond it). Subtract it from the scores."""
    start = max_tokens - buffer
    over = (np.asarray(agent_tokens, np.float32) - start) / float(buffer)
    return (penalty * np.clip(over, 0.0, 1.0)).astype(np.float32)


def _broadcast_to_mask(per_row: Array, loss_mask: Array) -> Array:
    return jnp.where(_is_on(loss_mask), per_row[:, None], 0.0).astype(jnp.float32)


def _group_stats(scores: Array, group_ids: Array, valid: Array) -> tuple[Array, Array, Array]:
    """Per-row (group count, group sum, group sum of squared deviations) over valid rows of the same group."""
    batch = scores.shape[0]
    # Dense ids in [0, B) so arbitrary int group ids work with num_segments=B.
    _, dense = jnp.unique(group_ids, size=batch, fill_value=0, return_inverse=True)
    dense = dense.reshape(batch)
    weight = valid.astype(jnp.float32)
    scores = jnp.where(valid, scores.astype(jnp.float32), 0.0)
    count = jax.ops.segment_sum(weight, dense, num_segments=batch)[dense]
    total = jax.ops.segment_sum(scores, dense, num_segments=batch)[dense]
    mean = total / jnp.maximum(count, 1.0)
    sq_dev = jax.ops.segment_sum(weight * (scores - mean) ** 2, dense, num_segments=batch)[dense]
    return count, total, sq_dev


# --------------------------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------------------------


@ESTIMATORS.register("grpo", requires=("scores", "loss_mask", "group_ids"))
def grpo_advantages(
    *,
    scores: Array,
    loss_mask: Array,
    group_ids: Array,
    normalize_std: bool = True,
    std_eps: float = GRPO_EPS,
) -> tuple[Array, Array]:
    """GRPO: ``(s - group mean) / (group std + eps)`` with the unbiased std, broadcast to agent tokens.

    A group of size 1 uses mean 0 and std 1 (its advantage is its score). ``normalize_std=False`` skips the
    std division (Dr. GRPO).
    """
    valid = row_has_tokens(loss_mask)
    count, total, sq_dev = _group_stats(scores, group_ids, valid)
    multi = count > 1
    mean = jnp.where(multi, total / jnp.maximum(count, 1.0), 0.0)
    std = jnp.where(multi, jnp.sqrt(sq_dev / jnp.maximum(count - 1.0, 1.0)), 1.0)
    centered = scores.astype(jnp.float32) - mean
    per_row = centered / (std + std_eps) if normalize_std else centered
    advantages = _broadcast_to_mask(jnp.where(valid, per_row, 0.0), loss_mask)
    return advantages, advantages


@ESTIMATORS.register("rloo", requires=("scores", "loss_mask", "group_ids"), min_group_size=2)
def rloo_advantages(*, scores: Array, loss_mask: Array, group_ids: Array) -> tuple[Array, Array]:
    """RLOO: ``s_i - mean_{j != i} s_j`` within the group, broadcast to agent tokens.

    Needs every group to have at least 2 valid rows (check with :func:`check_group_sizes` outside jit); a
    singleton group has no leave-one-out baseline and gets advantage 0.
    """
    valid = row_has_tokens(loss_mask)
    count, total, _ = _group_stats(scores, group_ids, valid)
    s = scores.astype(jnp.float32)
    others_mean = (total - s) / jnp.maximum(count - 1.0, 1.0)
    per_row = jnp.where(valid & (count > 1), s - others_mean, 0.0)
    advantages = _broadcast_to_mask(per_row, loss_mask)
    return advantages, advantages


def _reverse_scan(step: Callable[[Any, Any], tuple[Any, Array]], init: Any, xs: tuple[Array, ...]) -> Array:
    """Runs ``step`` from the last time step to the first over ``[B, T]`` inputs; returns ``[B, T]`` outputs."""
    xs_time_major = tuple(jnp.swapaxes(x, 0, 1) for x in xs)
    _, ys = jax.lax.scan(step, init, xs_time_major, reverse=True)
    return jnp.swapaxes(ys, 0, 1)


def discounted_agent_returns(token_rewards: Array, loss_mask: Array, gamma: float) -> Array:
    """``G_t = r_t + gamma * G_next`` over agent tokens only; masked tokens pass ``G`` through unchanged.

    Returns ``[B, T]`` with zeros outside the mask.
    """
    on = _is_on(loss_mask)
    rewards = jnp.where(on, token_rewards, 0.0).astype(jnp.float32)

    def step(running: Array, x: tuple[Array, Array]) -> tuple[Array, Array]:
        reward_t, on_t = x
        updated = jnp.where(on_t, reward_t + gamma * running, running)
        return updated, jnp.where(on_t, updated, 0.0)

    init = jnp.zeros(rewards.shape[0], jnp.float32)
    return _reverse_scan(step, init, (rewards, on))


@ESTIMATORS.register("reinforce_pp", requires=("scores", "loss_mask"))
def reinforce_pp_advantages(
    *,
    scores: Array,
    loss_mask: Array,
    old_logp: Array | None = None,
    ref_logp: Array | None = None,
    gamma: float = 1.0,
    reward_kl_coef: float = 0.0,
) -> tuple[Array, Array]:
    """REINFORCE++: whitened discounted return of (score on last agent token - reward_kl_coef * k1 per token).

    The return runs over agent tokens only (environment tokens are transparent) and is whitened over the batch
    mask. Returns ``(whitened advantages, raw returns)``. ``reward_kl_coef=0`` needs no log-probs.
    """
    rewards = outcome_token_rewards(scores, loss_mask)
    if reward_kl_coef != 0.0:
        if old_logp is None or ref_logp is None:
            raise AdvantageError(f"reinforce_pp with reward_kl_coef={reward_kl_coef} needs old_logp and ref_logp; "
                                 "pass them or set it to 0.")
        rewards = rewards + k1_reward_penalty(old_logp, ref_logp, loss_mask, reward_kl_coef)
    returns = discounted_agent_returns(rewards, loss_mask, gamma)
    return masked_whiten(returns, loss_mask), returns


@ESTIMATORS.register("gae", requires=("scores", "loss_mask", "values"), uses_critic=True)
def gae_advantages(
    *,
    scores: Array,
    loss_mask: Array,
    values: Array,
    old_logp: Array | None = None,
    ref_logp: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten_advantages: bool = True,
    reward_kl_coef: float = 0.0,
) -> tuple[Array, Array]:
    """GAE over agent tokens only, for PPO with a critic.

    Environment tokens are transparent: the next value and the running GAE carry across them unchanged, and
    values are read only at agent positions. The score is the reward of the last agent token, whose next value
    is 0. ``reward_kl_coef > 0`` subtracts ``reward_kl_coef * (old_logp - ref_logp)`` from each agent token's
    reward. Returns ``(advantages, returns)`` with ``returns = advantages + values`` (before whitening) on the
    mask; advantages are whitened over the mask unless ``whiten_advantages=False``.
    """
    on = _is_on(loss_mask)
    rewards = outcome_token_rewards(scores, loss_mask)
    if reward_kl_coef != 0.0:
        if old_logp is None or ref_logp is None:
            raise AdvantageError(f"gae with reward_kl_coef={reward_kl_coef} needs old_logp and ref_logp; pass them "
                                 "or set it to 0.")
        rewards = rewards + k1_reward_penalty(old_logp, ref_logp, loss_mask, reward_kl_coef)
    safe_values = jnp.where(on, values, 0.0).astype(jnp.float32)

    def step(carry: tuple[Array, Array], x: tuple[Array, Array, Array]) -> tuple[tuple[Array, Array], Array]:
        next_value, next_gae = carry
        reward_t, value_t, on_t = x
        delta = reward_t + gamma * next_value - value_t
        gae_t = delta + gamma * lam * next_gae
        carry = (jnp.where(on_t, value_t, next_value), jnp.where(on_t, gae_t, next_gae))
        return carry, jnp.where(on_t, gae_t, 0.0)

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    advantages = _reverse_scan(step, (zeros, zeros), (rewards, safe_values, on))
    returns = jnp.where(on, advantages + safe_values, 0.0)
    if whiten_advantages:
        advantages = masked_whiten(advantages, loss_mask)
    return advantages, returns


# --------------------------------------------------------------------------------------------------------------
# Registry access
# --------------------------------------------------------------------------------------------------------------


def get_estimator(name: str) -> Entry:
    """The estimator registered as ``name``; raises :class:`AdvantageError` listing the valid names."""
    if name not in ESTIMATORS:
        raise AdvantageError(f"Unknown advantage estimator {name!r}; valid names: {', '.join(ESTIMATORS.names())} "
                             "(load a module that registers another with algo.import_modules).")
    return ESTIMATORS.get(name)


def compute_advantages(name: str, **kwargs: Any) -> tuple[Array, Array]:
    """Runs estimator ``name`` on batch fields and options given as keywords; returns (advantages, returns).

    Batch fields (:data:`BATCH_FIELDS`) the estimator does not use are dropped, so a trainer can pass the
    whole batch to any estimator. Missing required fields and unknown options raise :class:`AdvantageError`
    naming them. Jit it with the name and options bound, e.g.
    ``jax.jit(functools.partial(compute_advantages, "gae", lam=0.95))``.
    """
    estimator = get_estimator(name)
    missing = [f for f in estimator.requires if kwargs.get(f) is None]
    if missing:
        raise AdvantageError(f"Estimator {name!r} needs batch field(s) {missing}; got {sorted(kwargs)}.")
    accepted = set(inspect.signature(estimator.fn).parameters)
    unknown = sorted(set(kwargs) - accepted - set(BATCH_FIELDS))
    if unknown:
        raise AdvantageError(f"Estimator {name!r} does not accept {unknown}; it accepts {sorted(accepted)}.")
    return estimator.fn(**{k: v for k, v in kwargs.items() if k in accepted})


def check_group_sizes(group_ids: np.ndarray, min_size: int, loss_mask: np.ndarray | None = None) -> None:
    """Host-side check that every group has at least ``min_size`` rows (rows with an agent token, if a mask
    is given). Raises :class:`AdvantageError` naming the offending groups and the fix."""
    ids = np.asarray(group_ids).reshape(-1)
    if loss_mask is not None:
        mask = np.asarray(loss_mask)
        if mask.shape[0] != ids.shape[0]:
            raise AdvantageError(f"group_ids has {ids.shape[0]} rows but loss_mask has {mask.shape[0]}.")
        ids = ids[(mask > 0).any(axis=-1)]
    unique, counts = np.unique(ids, return_counts=True)
    small = {int(g): int(c) for g, c in zip(unique, counts) if c < min_size}
    if small:
        shown = dict(list(small.items())[:10])
        raise AdvantageError(
            f"{len(small)} group(s) have fewer than {min_size} trajectories (group id: size, first 10: {shown}); "
            f"sample at least {min_size} trajectories per task (rollout n >= {min_size})."
        )


def check_estimator_inputs(name: str, group_ids: np.ndarray | None, loss_mask: np.ndarray) -> None:
    """Host-side validation before a jitted estimator runs: known name, non-empty mask, big-enough groups."""
    estimator = get_estimator(name)
    mask = np.asarray(loss_mask)
    if not (mask > 0).any():
        raise AdvantageError("The loss mask is all zero: the batch has no agent tokens to train on.")
    if estimator.min_group_size > 1:
        if group_ids is None:
            raise AdvantageError(f"Estimator {name!r} needs group_ids.")
        check_group_sizes(group_ids, estimator.min_group_size, mask)


def estimator_names() -> tuple[str, ...]:
    """The registered estimator names."""
    return ESTIMATORS.names()


def advantage_stats(advantages: Array, returns: Array, loss_mask: Array) -> Mapping[str, Array]:
    """Masked mean/std/min/max of advantages and returns, for metrics."""
    on = _is_on(loss_mask)
    stats = {}
    for label, x in (("advantages", advantages), ("returns", returns)):
        stats[f"{label}/mean"] = masked_mean(x, loss_mask)
        stats[f"{label}/std"] = jnp.sqrt(masked_var(x, loss_mask, unbiased=False))
        stats[f"{label}/max"] = jnp.max(jnp.where(on, x, -jnp.inf))
        stats[f"{label}/min"] = jnp.min(jnp.where(on, x, jnp.inf))
    return stats


from agentgym_jax import gigpo as _gigpo  # noqa: E402,F401  (registers "gigpo")
