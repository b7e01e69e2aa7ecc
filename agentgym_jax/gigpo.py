"""GiGPO (Feng et al., 2025, "Group-in-Group Policy Optimization for LLM Agent Training"): step-level credit.

Two nested groups per task: the episode group (GRPO on each trajectory's outcome) and, inside it, step groups of
every turn, across the group's trajectories, taken in the same environment state (an "anchor state": the env's
``info["state_key"]``). A turn's step advantage compares its discounted return from that turn on,
``R_t = sum_k step_gamma^(k-t) r_k`` over the turn rewards ``r_k``, with the other turns taken in the same state.
An agent token of turn ``t`` gets ``A_episode + step_weight * A_step(t)``; a state visited once gets step
advantage 0. ``normalize_std`` divides both by their group's std (the paper's default), else only centers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentgym_jax.advantages import GRPO_EPS, grpo_advantages, register_estimator, row_has_tokens

Array = jax.Array


def discounted_step_returns(step_rewards: Array, step_valid: Array, step_gamma: float) -> Array:
    """``[B, S]`` return of every turn from itself on (0 where ``step_valid`` is False)."""
    rewards = jnp.where(step_valid, step_rewards, 0.0).astype(jnp.float32)

    def step(running: Array, x: tuple[Array, Array]) -> tuple[Array, Array]:
        reward, valid = x
        updated = jnp.where(valid, reward + step_gamma * running, running)
        return updated, jnp.where(valid, updated, 0.0)

    _, returns = jax.lax.scan(step, jnp.zeros(rewards.shape[0], jnp.float32),
                              (rewards.T, step_valid.T), reverse=True)
    return returns.T


def _dense(ids: Array) -> Array:
    """Maps arbitrary int ids to dense ids in [0, n) (n = ids.size), keeping equality."""
    _, dense = jnp.unique(ids, size=ids.size, fill_value=0, return_inverse=True)
    return dense.reshape(ids.shape)


def step_group_advantages(returns: Array, step_states: Array, group_ids: Array, valid: Array,
                          normalize_std: bool, std_eps: float) -> Array:
    """``[B, S]`` step advantages: each turn's return against the turns of its (episode group, state) group."""
    rows, steps = returns.shape
    episode_group = jnp.broadcast_to(_dense(group_ids)[:, None], (rows, steps))
    key = episode_group * (rows * steps) + _dense(jnp.where(valid, step_states, -1))
    segment = _dense(jnp.where(valid, key, -1)).reshape(-1)
    weight = valid.reshape(-1).astype(jnp.float32)
    flat = jnp.where(valid, returns, 0.0).reshape(-1)
    count = jax.ops.segment_sum(weight, segment, num_segments=rows * steps)[segment]
    mean = jax.ops.segment_sum(flat, segment, num_segments=rows * steps)[segment] / jnp.maximum(count, 1.0)
    sq_dev = jax.ops.segment_sum(weight * (flat - mean) ** 2, segment, num_segments=rows * steps)[segment]
    std = jnp.sqrt(sq_dev / jnp.maximum(count - 1.0, 1.0))
    centered = flat - mean
    advantage = centered / (std + std_eps) if normalize_std else centered
    return jnp.where((count > 1) & (weight > 0), advantage, 0.0).reshape(rows, steps)


@register_estimator("gigpo", requires=("scores", "loss_mask", "group_ids", "turn_ids", "step_rewards", "step_states"))
def gigpo_advantages(
    *,
    scores: Array,
    loss_mask: Array,
    group_ids: Array,
    turn_ids: Array,
    step_rewards: Array,
    step_states: Array,
    step_gamma: float = 0.95,
    step_weight: float = 1.0,
    normalize_std: bool = True,
    std_eps: float = GRPO_EPS,
) -> tuple[Array, Array]:
    """GiGPO advantages ``[B, T]`` and the per-token step returns (see the module docstring)."""
    episode, _ = grpo_advantages(scores=scores, loss_mask=loss_mask, group_ids=group_ids,
                                 normalize_std=normalize_std, std_eps=std_eps)
    valid = (step_states >= 0) & row_has_tokens(loss_mask)[:, None]
    returns = discounted_step_returns(step_rewards, valid, step_gamma)
    step = step_group_advantages(returns, step_states, group_ids, valid, normalize_std, std_eps)
    on = (loss_mask > 0) & (turn_ids >= 0)
    turn = jnp.clip(turn_ids, 0, step_rewards.shape[1] - 1)
    per_token_step = jnp.where(on, jnp.take_along_axis(step, turn, axis=1), 0.0)
    per_token_return = jnp.where(on, jnp.take_along_axis(returns, turn, axis=1), 0.0)
    return episode + step_weight * per_token_step, per_token_return
