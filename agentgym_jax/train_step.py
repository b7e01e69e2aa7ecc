"""The learner's two jitted programs as pure functions of their inputs: the experience pass (reference and
recomputed log-probs, critic values) and the train step (one optimizer update of the policy, and of the critic
with GAE, from a minibatch stacked into micro-batches; skipped when the loss or gradient is not finite)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from agentgym_jax import lora
from agentgym_jax.learner_config import LearnerConfig
from agentgym_jax.policy_objective import (TrainingBatch, _accumulated_grads, _keep_if, loss_denominator,
                                           policy_loss, token_logprobs, value_loss)

Array = jax.Array


def experience_program(config: LearnerConfig, train_graphdef: Any, critic_graphdef: Any, lora_policy: bool
                       ) -> Callable[..., dict[str, Array]]:
    """``(policy, reference, critic, tokens, positions, packed?) -> {old_logp?, ref_logp?, values?}`` for one
    micro-batch, of packed rows when given ``packed`` (their RoPE positions, segments and sources; no critic then).

    Under LoRA the reference is the policy with its adapters zeroed (no second copy of the weights).
    """
    uses_critic, use_reference = config.uses_critic, config.use_reference
    recompute = config.old_logp_source == "recompute"

    def _learner_experience(policy: Any, reference: Any, critic: Any, tokens: Array, positions: Array,
                            packed: tuple[Array, Array, Array, Array] | None = None) -> dict[str, Array]:
        out = {}
        if lora_policy:
            reference = lora.without_adapters(policy)
        if packed is not None:  # packed rows: (RoPE positions, blocks, branches, sources); no critic reads them
            rope_positions, blocks, branches, sources = packed
            packed = TrainingBatch(tokens, positions, None, None, None, None, None, None, sources=sources,
                                   rope_positions=rope_positions, blocks=blocks, branches=branches)
        logprobs = functools.partial(token_logprobs, tokens=tokens, temperature=config.temperature,
                                     chunk_size=config.logprob_chunk_size, positions=positions, packed=packed)
        if recompute:
            out["old_logp"] = logprobs(nnx.merge(train_graphdef, policy))[0]
        if use_reference:
            out["ref_logp"] = logprobs(nnx.merge(train_graphdef, reference))[0]
        if uses_critic:
            out["values"] = nnx.merge(critic_graphdef, critic).values(tokens)
        return out

    return _learner_experience


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What the train step closes over: settings, graph definitions, optimizers, schedules, output shardings."""

    config: LearnerConfig
    train_graphdef: Any
    critic_graphdef: Any
    split_trainable: Callable[[Any], tuple[Any, Any]]  # policy state -> (what trains, the rest or None)
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    critic_optimizer: optax.GradientTransformation | None
    critic_schedule: optax.Schedule | None
    param_shardings: Any
    critic_shardings: Any


def train_step_program(parts: StepParts) -> Callable[..., tuple[Any, Any, Any, Any, dict[str, Array]]]:
    """``(policy, opt_state, critic, critic_opt, stack, step) -> (the same, updated; metrics)``.

    ``stack`` is a :class:`TrainingBatch` with a leading micro-batch axis; the loss denominator is that of the
    whole minibatch, so the accumulated gradient is exact. An update with a non-finite loss or gradient, or with
    no agent tokens, leaves parameters and optimizer states unchanged (``metrics["applied"]`` is False).
    """
    config = parts.config
    policy_loss_fn = functools.partial(policy_loss, config=config)
    value_loss_fn = functools.partial(value_loss, config=config)
    uses_critic = config.uses_critic

    def _learner_train_step(
        policy: Any, opt_state: Any, critic: Any, critic_opt: Any, stack: TrainingBatch, step: Array
    ) -> tuple[Any, Any, Any, Any, dict[str, Array]]:
        mask = stack.loss_mask
        denominator = loss_denominator(config.loss_aggregation, mask.reshape(-1, mask.shape[-1]))
        trainable, fixed = parts.split_trainable(policy)
        grads, aux = _accumulated_grads(policy_loss_fn, parts.train_graphdef, trainable, stack, denominator, fixed)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt = parts.optimizer.update(grads, opt_state, trainable)
        new_trainable = optax.apply_updates(trainable, updates)
        finite = jnp.isfinite(aux["total_loss"]) & jnp.isfinite(grad_norm)
        metrics = dict(aux, grad_norm=grad_norm, lr=parts.schedule(step))
        if uses_critic:
            critic_grads, critic_aux = _accumulated_grads(value_loss_fn, parts.critic_graphdef, critic, stack,
                                                          denominator)
            critic_norm = optax.tree.norm(critic_grads)
            critic_updates, new_critic_opt = parts.critic_optimizer.update(critic_grads, critic_opt, critic)
            new_critic = optax.apply_updates(critic, critic_updates)
            finite = finite & jnp.isfinite(critic_aux["value_loss"]) & jnp.isfinite(critic_norm)
            metrics.update(critic_aux, critic_grad_norm=critic_norm, critic_lr=parts.critic_schedule(step))
        nonempty = denominator > 0
        apply = finite & nonempty
        trainable_out = _keep_if(apply, new_trainable, trainable)
        policy_out = trainable_out if fixed is None else nnx.merge_state(trainable_out, fixed)
        opt_out = _keep_if(apply, new_opt, opt_state)
        if parts.param_shardings is not None:
            policy_out = jax.lax.with_sharding_constraint(policy_out, parts.param_shardings)
        if uses_critic:
            critic, critic_opt = _keep_if(apply, new_critic, critic), _keep_if(apply, new_critic_opt, critic_opt)
            if parts.critic_shardings is not None:
                critic = jax.lax.with_sharding_constraint(critic, parts.critic_shardings)
        metrics.update(finite=finite, nonempty=nonempty, applied=apply, denominator=denominator)
        return policy_out, opt_out, critic, critic_opt, metrics

    return _learner_train_step
