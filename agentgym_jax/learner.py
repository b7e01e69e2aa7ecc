"""The learner: optimizer, train state and the jitted, sharded PPO-style train step over trajectory batches.

One :meth:`Learner.update` call consumes one rollout batch:

1. host checks (shapes, mask, group sizes, divisibility by the minibatch/microbatch sizes and the mesh);
2. an experience pass, one micro-batch at a time: reference log-probs (frozen initial policy), recomputed
   behaviour log-probs (``old_logp_source='recompute'``) and critic values (PPO);
3. advantages and returns over the whole batch with the estimator named in the config;
4. ``ppo_epochs`` passes over the batch, each shuffled (with the given rng) into minibatches of
   ``minibatch_size`` trajectories; each minibatch is one optimizer update, its gradient accumulated exactly over
   micro-batches of ``microbatch_size`` rows (the loss denominator of the whole minibatch is computed first and
   every micro-batch's numerator is divided by it).

The policy parameters are the very arrays the sampler reads (``learner.policy_state``). With ``donate=True``
(the default) each update reuses their buffers in place, so after :meth:`Learner.update` re-point the sampler:
``sampler.update_params(learner.policy_state)``; the model object passed to the constructor no longer holds live
arrays then (use :meth:`Learner.policy_model`).

A minibatch whose loss or gradient is NaN/inf is skipped (parameters and optimizer states unchanged), counted in
the ``skipped_updates`` metric and logged as a warning. ``learner.step`` counts the optimizer updates applied.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import advantages as adv_lib
from agentgym_jax import freezing, lora, losses, sharding
from agentgym_jax.batch import BatchError, TrajectoryBatch
from agentgym_jax.buckets import bucket
from agentgym_jax.critic import Critic, copy_tree
from agentgym_jax.errors import CheckpointError, ConfigError
from agentgym_jax.model import DecoderLM, abstract_model, to_dtype

log = logging.getLogger(__name__)

Array = jax.Array
LR_SCHEDULES = ("constant", "cosine", "linear")
OLD_LOGP_SOURCES = ("recompute", "sampler")
TRAIN_STEP_NAME = "_learner_train_step"
EXPERIENCE_NAME = "_learner_experience"


# --------------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Hyperparameters of the learner. Defaults are the original AgentGym-RL GRPO recipe.

    Sizes: ``minibatch_size`` trajectories per optimizer update (None: the whole batch), split into micro-batches
    of ``microbatch_size`` rows for gradient accumulation (None: no accumulation). Both count rows, padding rows
    included; the batch's rows must be a multiple of ``minibatch_size`` (pad with ``TrajectoryBatch.pad_rows``).
    """

    # advantages
    advantage_estimator: str = "grpo"
    normalize_std: bool = True  # grpo: divide by the group std (False: Dr. GRPO)
    gamma: float = 1.0  # reinforce_pp, gae
    lam: float = 1.0  # gae
    whiten_advantages: bool = True  # gae
    # policy loss
    loss_aggregation: str = "seq-mean-token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None  # dual-clip bound (> 1); None disables it
    kl_coef: float = 0.001
    kl_estimator: str = "k3"
    kl_in_reward: bool = False  # True: k1 penalty in the reward (reinforce_pp, gae) instead of a loss term
    entropy_coef: float = 0.001
    temperature: float = 1.0  # log-probs are of logits / temperature
    logprob_chunk_size: int | None = None  # None: full [B, T, V] logits; else positions per chunk
    # 'recompute': forward before the update; 'sampler': batch.old_logp, which must then be at ``temperature``
    # (the Trainer builds its Sampler with ``logprob_temperature`` = this temperature)
    old_logp_source: str = "recompute"
    use_reference: bool = True  # keep a frozen copy of the initial policy for the KL term / metric
    # optimizer (policy)
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_steps: int | None = None  # optimizer updates; needed by 'cosine' and 'linear'
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip_norm: float | None = 1.0
    # batching
    ppo_epochs: int = 1
    minibatch_size: int | None = None
    microbatch_size: int | None = None
    # critic (gae only)
    value_clip: float | None = 0.5
    critic_learning_rate: float = 1e-5
    critic_warmup_steps: int = 0
    # numerics and memory
    compute_dtype: str | None = None  # None: the model's; 'bfloat16' with float32 params = mixed precision
    remat: bool | None = None  # None: the model's setting
    trainable_layers: int = 0  # train only the top N decoder layers (+ final norm and head); 0 = all layers
    donate: bool = True  # update parameter and optimizer buffers in place

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs a value model."""
        return adv_lib.get_estimator(self.advantage_estimator).uses_critic

    @property
    def kl_loss_active(self) -> bool:
        """Whether the KL to the reference is a term of the policy loss."""
        return self.kl_coef != 0.0 and not self.kl_in_reward

    def validate(self) -> None:
        """Raises :class:`ConfigError` naming the field for an unknown name or an out-of-range value."""
        try:
            estimator = adv_lib.get_estimator(self.advantage_estimator)
        except adv_lib.AdvantageError as error:
            raise ConfigError(f"advantage_estimator: {error}") from None
        for field, registry in (("loss_aggregation", losses.get_aggregation), ("kl_estimator", losses.get_kl_estimator)):
            try:
                registry(getattr(self, field))
            except losses.LossConfigError as error:
                raise ConfigError(f"{field}: {error}") from None
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _choice("old_logp_source", self.old_logp_source, OLD_LOGP_SOURCES)
        _at_least("clip_low", self.clip_low, 0.0)
        _at_least("clip_high", self.clip_high, 0.0)
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ConfigError(f"clip_ratio_c must be > 1 (e.g. 3.0) or None to disable dual-clip; got {self.clip_ratio_c}")
        _at_least("kl_coef", self.kl_coef, 0.0)
        _at_least("entropy_coef", self.entropy_coef, 0.0)
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.kl_coef > 0 and not self.use_reference:
            raise ConfigError(f"kl_coef={self.kl_coef} needs the reference policy; set use_reference=True or kl_coef=0")
        if self.kl_in_reward and self.kl_coef > 0 and "kl_coef" not in estimator.options():
            raise ConfigError(
                f"kl_in_reward=True is supported by the token-level estimators (reinforce_pp, gae), not "
                f"{self.advantage_estimator!r}; set kl_in_reward=False to use the KL as a loss term"
            )
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"gamma must be in (0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise ConfigError(f"lam must be in [0, 1], got {self.lam}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            raise ConfigError(f"logprob_chunk_size must be >= 1 or None, got {self.logprob_chunk_size}")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not self.critic_learning_rate > 0:
            raise ConfigError(f"critic_learning_rate must be > 0, got {self.critic_learning_rate}")
        _at_least("warmup_steps", self.warmup_steps, 0)
        _at_least("critic_warmup_steps", self.critic_warmup_steps, 0)
        if self.lr_schedule != "constant":
            if self.total_steps is None or self.total_steps <= max(self.warmup_steps, self.critic_warmup_steps):
                raise ConfigError(
                    f"lr_schedule={self.lr_schedule!r} needs total_steps (optimizer updates) greater than the warmup "
                    f"steps; got total_steps={self.total_steps}"
                )
        _at_least("weight_decay", self.weight_decay, 0.0)
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ConfigError(f"eps must be > 0, got {self.eps}")
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ConfigError(f"grad_clip_norm must be > 0 or None, got {self.grad_clip_norm}")
        _at_least("ppo_epochs", self.ppo_epochs, 1)
        for name in ("minibatch_size", "microbatch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1 or None, got {value}")
        if self.minibatch_size and self.microbatch_size and self.minibatch_size % self.microbatch_size:
            raise ConfigError(
                f"minibatch_size={self.minibatch_size} must be a multiple of microbatch_size={self.microbatch_size}"
            )
        if self.value_clip is not None and self.value_clip < 0:
            raise ConfigError(f"value_clip must be >= 0 or None, got {self.value_clip}")
        if self.compute_dtype is not None:
            to_dtype(self.compute_dtype)
        _at_least("trainable_layers", self.trainable_layers, 0)
        if self.trainable_layers and self.uses_critic:
            raise ConfigError("trainable_layers applies to the policy only; with advantage_estimator='gae' the critic "
                              "would train all layers. Set trainable_layers=0 or use a critic-free estimator")


def _choice(field: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"{field}: unknown value {value!r}; valid values: {', '.join(valid)}")


def _at_least(field: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"{field} must be >= {low}, got {value}")


# --------------------------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------------------------


def learning_rate_schedule(
    peak: float, warmup_steps: int, kind: str, total_steps: int | None
) -> optax.Schedule:
    """Linear warmup from 0 to ``peak`` over ``warmup_steps``, then constant, cosine or linear decay to 0."""
    _choice("lr_schedule", kind, LR_SCHEDULES)
    if kind == "constant":
        after = optax.constant_schedule(peak)
    elif kind == "cosine":
        after = optax.cosine_decay_schedule(peak, total_steps - warmup_steps)
    else:
        after = optax.linear_schedule(peak, 0.0, total_steps - warmup_steps)
    if warmup_steps == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup_steps), after], [warmup_steps])


def make_optimizer(config: LearnerConfig, learning_rate: float, warmup_steps: int) -> tuple[
    optax.GradientTransformation, optax.Schedule
]:
    """AdamW (decoupled weight decay on every parameter, as torch) after global-norm clipping, with a schedule."""
    schedule = learning_rate_schedule(learning_rate, warmup_steps, config.lr_schedule, config.total_steps)
    adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay)
    if config.grad_clip_norm is None:
        return adamw, schedule
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adamw), schedule


# --------------------------------------------------------------------------------------------------------------
# Log-probs and losses (pure functions; the train step and the tests use these very functions)
# --------------------------------------------------------------------------------------------------------------


def to_token_positions(per_prediction: Array) -> Array:
    """Moves values computed at position t-1 (predicting token t) to position t; position 0 gets 0."""
    return jnp.pad(per_prediction[:, :-1], ((0, 0), (1, 0)))


def token_logprobs_from_logits(logits: Array, tokens: Array, temperature: float = 1.0) -> tuple[Array, Array]:
    """``(logp, entropy)`` [B, T] of each token under ``logits`` [B, T, V] read at the previous position."""
    logits = logits.astype(jnp.float32) / temperature
    targets = jnp.roll(tokens, -1, axis=1)
    logp = losses.logprobs_from_logits(logits, targets)
    entropy = losses.entropy_from_logits(logits)
    return to_token_positions(logp), to_token_positions(entropy)


def unembedding(model: DecoderLM) -> Array:
    """The output projection [D, V] in the compute dtype (the transposed embeddings when tied)."""
    dtype = to_dtype(model.config.dtype)
    if model.config.tie_word_embeddings:
        return model.model.embed_tokens.weight[...].astype(dtype).T
    return model.lm_head.kernel[...].astype(dtype)


AGENT_POSITION_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def agent_positions(loss_mask: np.ndarray) -> np.ndarray:
    """``[B, K]`` int32 indices of each row's loss-mask tokens, padded with -1; K is a bucket of the largest count.

    The learner reads log-probs only there, so the output head (a large share of a small model's compute) runs
    on K positions per row instead of T.
    """
    on = np.asarray(loss_mask) > 0
    width = bucket(max(1, int(on.sum(axis=1).max(initial=0))), AGENT_POSITION_BUCKETS)
    positions = np.full((on.shape[0], width), -1, np.int32)
    for row, indices in enumerate(on):
        found = np.flatnonzero(indices)
        positions[row, : len(found)] = found
    return positions


def selected_logprobs(hidden: Array, tokens: Array, head: Array, positions: Array, temperature: float,
                      chunk_size: int | None = None) -> tuple[Array, Array]:
    """``(logp, entropy)`` [B, T] at ``positions`` [B, K] (-1 = none) from hidden states [B, T, D]; 0 elsewhere."""
    valid = positions > 0
    index = jnp.maximum(positions, 1)
    before = jnp.take_along_axis(hidden, (index - 1)[..., None], axis=1)  # the state that predicts each token
    targets = jnp.take_along_axis(tokens, index, axis=1)
    if temperature != 1.0:
        before = (before.astype(jnp.float32) / temperature).astype(before.dtype)
    if chunk_size is not None and positions.shape[1] > chunk_size:
        width = -(-positions.shape[1] // chunk_size) * chunk_size
        pad = width - positions.shape[1]
        logp, entropy = losses.chunked_logprobs_and_entropy(
            jnp.pad(before, ((0, 0), (0, pad), (0, 0))), head, jnp.pad(targets, ((0, 0), (0, pad))), chunk_size)
        logp, entropy = logp[:, : positions.shape[1]], entropy[:, : positions.shape[1]]
    else:
        logits = jnp.einsum("bkd,dv->bkv", before, head, preferred_element_type=jnp.float32)
        logp, entropy = losses.logprobs_from_logits(logits, targets), losses.entropy_from_logits(logits)
    logp, entropy = jnp.where(valid, logp, 0.0), jnp.where(valid, entropy, 0.0)
    rows = jnp.arange(tokens.shape[0])[:, None]
    scatter = lambda values: jnp.zeros(tokens.shape, jnp.float32).at[rows, index].add(values)
    return scatter(logp), scatter(entropy)


def token_logprobs(
    model: DecoderLM, tokens: Array, temperature: float = 1.0, chunk_size: int | None = None,
    positions: Array | None = None,
) -> tuple[Array, Array]:
    """``(logp, entropy)`` [B, T] float32 of each token of ``tokens`` [B, T] (0 at position 0).

    With ``positions`` ([B, K] from :func:`agent_positions`) only those tokens are scored (0 elsewhere). With
    ``chunk_size`` the ``[B, T, V]`` logits are never materialized at once (see
    :func:`losses.chunked_logprobs_and_entropy`); ``T`` is padded internally to a multiple of it.
    """
    hidden, _ = model.forward(tokens)
    if positions is not None:
        return selected_logprobs(hidden, tokens, unembedding(model), positions, temperature, chunk_size)
    if chunk_size is None:
        return token_logprobs_from_logits(model.logits(hidden), tokens, temperature)
    if temperature != 1.0:
        hidden = (hidden.astype(jnp.float32) / temperature).astype(hidden.dtype)
    targets = jnp.roll(tokens, -1, axis=1)
    length = tokens.shape[1]
    padded = -(-length // chunk_size) * chunk_size
    if padded != length:
        hidden = jnp.pad(hidden, ((0, 0), (0, padded - length), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, padded - length)))
    logp, entropy = losses.chunked_logprobs_and_entropy(hidden, unembedding(model), targets, chunk_size)
    return to_token_positions(logp[:, :length]), to_token_positions(entropy[:, :length])


def loss_denominator(aggregation: str, loss_mask: Array) -> Array:
    """The denominator of ``aggregation`` over ``loss_mask`` (it depends on the mask only)."""
    return losses.aggregate_loss(aggregation, jnp.zeros_like(loss_mask, jnp.float32), loss_mask)[1]


def policy_loss_terms(
    logp: Array, entropy: Array, micro: Mapping[str, Array], denominator: Array, config: LearnerConfig
) -> tuple[Array, dict[str, Array]]:
    """The policy loss of one micro-batch, ``numerator / denominator``, from its token log-probs and entropies.

    ``micro`` holds ``loss_mask``, ``old_logp``, ``advantages`` and (KL loss) ``ref_logp``, all [B, T].
    ``denominator`` is that of the whole minibatch, so micro-batch losses and gradients simply add up. The aux
    dict holds each term's share of the minibatch loss and token sums for metrics.
    """
    mask = micro["loss_mask"]
    on = mask > 0
    aggregate = losses.get_aggregation(config.loss_aggregation)
    inverse = 1.0 / jnp.maximum(denominator, 1.0)
    terms = losses.ppo_clip_loss(
        logp, micro["old_logp"], micro["advantages"],
        clip_low=config.clip_low, clip_high=config.clip_high, clip_ratio_c=config.clip_ratio_c,
    )
    total = terms.loss
    aux: dict[str, Array] = {"policy_loss": aggregate(terms.loss, mask)[0] * inverse}
    if config.kl_loss_active:
        kl = losses.kl_divergence(config.kl_estimator, logp, micro["ref_logp"])
        total = total + config.kl_coef * kl
        aux["kl_loss"] = aggregate(kl, mask)[0] * inverse
    if config.entropy_coef:
        total = total - config.entropy_coef * entropy
    aux["entropy_loss"] = aggregate(entropy, mask)[0] * inverse
    loss = aggregate(total, mask)[0] * inverse
    aux["total_loss"] = loss

    def token_sum(x: Array) -> Array:
        return jnp.sum(jnp.where(on, x, 0.0))

    aux["sum/clip_frac"] = token_sum(terms.clipped)
    aux["sum/dual_clip_frac"] = token_sum(terms.dual_clipped)
    aux["sum/approx_kl"] = token_sum(losses.kl_k3(logp, micro["old_logp"]))
    aux["sum/ratio"] = token_sum(terms.ratio)
    aux["sum/abs_logp_gap"] = token_sum(jnp.abs(logp - micro["old_logp"]))
    aux["max/ratio"] = jnp.max(jnp.where(on, terms.ratio, 0.0))
    aux["sum/entropy"] = token_sum(entropy)
    if "ref_logp" in micro:
        aux["sum/ref_kl"] = token_sum(losses.kl_k3(logp, micro["ref_logp"]))
    aux["sum/tokens"] = jnp.sum(on.astype(jnp.float32))
    return loss, aux


def policy_loss(
    model: DecoderLM, micro: Mapping[str, Array], denominator: Array, config: LearnerConfig
) -> tuple[Array, dict[str, Array]]:
    """The train step's policy loss of one micro-batch (``micro['tokens']`` plus the fields of
    :func:`policy_loss_terms`)."""
    logp, entropy = token_logprobs(model, micro["tokens"], config.temperature, config.logprob_chunk_size,
                                   micro.get("positions"))
    return policy_loss_terms(logp, entropy, micro, denominator, config)


def value_loss(
    critic: Critic, micro: Mapping[str, Array], denominator: Array, config: LearnerConfig
) -> tuple[Array, dict[str, Array]]:
    """The clipped value loss of one micro-batch (``tokens``, ``loss_mask``, ``old_values``, ``returns``)."""
    mask = micro["loss_mask"]
    on = mask > 0
    values = critic.values(micro["tokens"])
    per_token, clipped = losses.clipped_value_loss(values, micro["old_values"], micro["returns"], clip_range=config.value_clip)
    loss = losses.aggregate_loss(config.loss_aggregation, per_token, mask)[0] / jnp.maximum(denominator, 1.0)
    aux = {
        "value_loss": loss,
        "sum/value_clip_frac": jnp.sum(jnp.where(on, clipped, 0.0)),
        "sum/values": jnp.sum(jnp.where(on, values, 0.0)),
        "sum/value_error": jnp.sum(jnp.where(on, jnp.square(values - micro["returns"]), 0.0)),
    }
    return loss, aux


def _accumulated_grads(
    loss_fn: Callable[..., tuple[Array, dict[str, Array]]],
    graphdef: Any,
    params: Any,
    stack: Mapping[str, Array],
    denominator: Array,
    fixed: Any = None,
) -> tuple[Any, dict[str, Array]]:
    """Sum over the leading micro-batch axis of ``stack`` of the gradient of ``loss_fn`` (exact accumulation),
    with respect to ``params`` only (``fixed``: the rest of the model's state, e.g. the base weights under LoRA)."""

    def grads_of(micro: Mapping[str, Array]) -> tuple[Any, dict[str, Array]]:
        def loss_of(p: Any) -> tuple[Array, dict[str, Array]]:
            model = nnx.merge(graphdef, p) if fixed is None else nnx.merge(graphdef, p, fixed)
            return loss_fn(model, micro, denominator)

        (_, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        return grads, aux

    count = next(iter(stack.values())).shape[0]
    if count == 1:
        return grads_of({k: v[0] for k, v in stack.items()})

    def body(total: Any, micro: Mapping[str, Array]) -> tuple[Any, dict[str, Array]]:
        grads, aux = grads_of(micro)
        return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), total, grads), aux

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    summed, aux = jax.lax.scan(body, zeros, stack)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), summed, params)
    return grads, {k: jnp.max(v, axis=0) if k.startswith("max/") else jnp.sum(v, axis=0) for k, v in aux.items()}


def _keep_if(ok: Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


# --------------------------------------------------------------------------------------------------------------
# The learner
# --------------------------------------------------------------------------------------------------------------


POLICY_FIELDS = ("tokens", "positions", "loss_mask", "old_logp", "advantages")
CRITIC_FIELDS = ("tokens", "loss_mask", "old_values", "returns")


class Learner:
    """Owns the policy (and critic) parameters, their optimizer states and the frozen reference policy."""

    def __init__(self, model: DecoderLM, config: LearnerConfig, mesh: Mesh | None = None):
        config.validate()
        self.config = config
        self.mesh = mesh
        if mesh is not None:
            sharding.check_model_fits_mesh(model.config, mesh)
        self._estimator = adv_lib.get_estimator(config.advantage_estimator)
        self._graphdef, policy = nnx.split(model)
        self._policy = self._commit(policy)
        non_params = [k for k, v in nnx.to_flat_state(self._policy) if not isinstance(v, nnx.Param)]
        if non_params:
            raise ConfigError(f"the policy holds non-parameter state {non_params[:3]}; the learner trains Params only")
        self._lora = model.config.lora_rank > 0  # train the adapters only; the base is also the KL reference
        if self._lora and config.uses_critic:
            raise ConfigError("LoRA policies train with critic-free estimators (grpo, rloo, reinforce_pp); a critic "
                              "would be a full copy of the model. Set lora_rank=0 or another advantage_estimator")
        frozen = freezing.frozen_layer_count(model.config.num_hidden_layers, config.trainable_layers)
        train_model_config = dataclasses.replace(
            model.config,
            dtype=config.compute_dtype or model.config.dtype,
            remat=model.config.remat if config.remat is None else config.remat,
            frozen_layers=frozen,
        )
        self._train_graphdef = nnx.split(abstract_model(train_model_config))[0]
        self._optimizer, self._schedule = make_optimizer(config, config.learning_rate, config.warmup_steps)
        if frozen:
            self._optimizer = freezing.freeze_layers(self._optimizer, frozen)
        with sharding.use_mesh(mesh):
            self._opt_state = self._commit(jax.jit(self._optimizer.init)(self._trainable(self._policy)[0]))
        # Under LoRA the reference is the policy with its adapters zeroed (lora.without_adapters): no copy.
        self._reference = copy_tree(self._policy) if config.use_reference and not self._lora else None
        self._critic = self._critic_opt = self._critic_graphdef = None
        self._critic_optimizer = self._critic_schedule = None
        if config.uses_critic:
            _, critic = nnx.split(Critic.from_policy(model, mesh))
            self._critic = self._commit(critic)
            self._critic_graphdef = nnx.split(nnx.eval_shape(lambda: Critic(train_model_config, nnx.Rngs(0))))[0]
            self._critic_optimizer, self._critic_schedule = make_optimizer(
                config, config.critic_learning_rate, config.critic_warmup_steps
            )
            with sharding.use_mesh(mesh):
                self._critic_opt = self._commit(jax.jit(self._critic_optimizer.init)(self._critic))
        self._step = 0
        self._updates_called = 0
        self._gradients_program = None
        self._build_programs()

    # ---------------------------------------------------------------------------------------- public state

    @property
    def policy_state(self) -> nnx.State:
        """The policy's parameters (``nnx.split(model)[1]`` layout): the arrays the Sampler reads."""
        return self._policy

    @property
    def critic_state(self) -> nnx.State | None:
        """The critic's parameters (None without a critic)."""
        return self._critic

    @property
    def reference_state(self) -> nnx.State | None:
        """The frozen reference policy's parameters (None when ``use_reference=False``)."""
        return self._reference

    @property
    def step(self) -> int:
        """Optimizer updates applied so far (skipped and empty minibatches not counted)."""
        return self._step

    def policy_model(self) -> DecoderLM:
        """The policy as a ``DecoderLM`` (the model's own numerics), sharing the learner's arrays."""
        return nnx.merge(self._graphdef, self._policy)

    def critic_model(self) -> Critic | None:
        """The critic as a module (None without one)."""
        if self._critic is None:
            return None
        return nnx.merge(self._critic_graphdef, self._critic)

    def learning_rate(self, step: int | None = None) -> float:
        """The policy learning rate at optimizer update ``step`` (default: the next one)."""
        return float(self._schedule(self._step if step is None else step))

    # ---------------------------------------------------------------------------------------- programs

    def _build_programs(self) -> None:
        config = self.config
        train_graphdef, critic_graphdef = self._train_graphdef, self._critic_graphdef
        uses_critic, use_reference = config.uses_critic, config.use_reference
        recompute = config.old_logp_source == "recompute"

        lora_policy = self._lora

        def _learner_experience(policy: Any, reference: Any, critic: Any, tokens: Array, positions: Array
                                ) -> dict[str, Array]:
            out = {}
            if lora_policy:
                reference = lora.without_adapters(policy)
            logprobs = functools.partial(
                token_logprobs, tokens=tokens, temperature=config.temperature, chunk_size=config.logprob_chunk_size,
                positions=positions,
            )
            if recompute:
                out["old_logp"] = logprobs(nnx.merge(train_graphdef, policy))[0]
            if use_reference:
                out["ref_logp"] = logprobs(nnx.merge(train_graphdef, reference))[0]
            if uses_critic:
                out["values"] = nnx.merge(critic_graphdef, critic).values(tokens)
            return out

        policy_loss_fn = functools.partial(policy_loss, config=config)
        split_trainable = self._trainable
        value_loss_fn = functools.partial(value_loss, config=config)
        optimizer, critic_optimizer = self._optimizer, self._critic_optimizer
        schedule, critic_schedule = self._schedule, self._critic_schedule
        param_shardings = self._shardings(self._policy)
        critic_shardings = self._shardings(self._critic)

        def _learner_train_step(
            policy: Any, opt_state: Any, critic: Any, critic_opt: Any, stack: dict[str, Array], step: Array
        ) -> tuple[Any, Any, Any, Any, dict[str, Array]]:
            mask = stack["loss_mask"]
            denominator = loss_denominator(config.loss_aggregation, mask.reshape(-1, mask.shape[-1]))
            policy_stack = {k: stack[k] for k in POLICY_FIELDS + (("ref_logp",) if "ref_logp" in stack else ())}
            trainable, fixed = split_trainable(policy)
            grads, aux = _accumulated_grads(policy_loss_fn, train_graphdef, trainable, policy_stack, denominator,
                                            fixed)
            grad_norm = optax.tree.norm(grads)
            updates, new_opt = optimizer.update(grads, opt_state, trainable)
            new_trainable = optax.apply_updates(trainable, updates)
            finite = jnp.isfinite(aux["total_loss"]) & jnp.isfinite(grad_norm)
            metrics = dict(aux, grad_norm=grad_norm, lr=schedule(step))
            if uses_critic:
                critic_stack = {k: stack[k] for k in CRITIC_FIELDS}
                critic_grads, critic_aux = _accumulated_grads(
                    value_loss_fn, critic_graphdef, critic, critic_stack, denominator
                )
                critic_norm = optax.tree.norm(critic_grads)
                critic_updates, new_critic_opt = critic_optimizer.update(critic_grads, critic_opt, critic)
                new_critic = optax.apply_updates(critic, critic_updates)
                finite = finite & jnp.isfinite(critic_aux["value_loss"]) & jnp.isfinite(critic_norm)
                metrics.update(critic_aux, critic_grad_norm=critic_norm, critic_lr=critic_schedule(step))
            nonempty = denominator > 0
            apply = finite & nonempty
            trainable_out = _keep_if(apply, new_trainable, trainable)
            policy_out = trainable_out if fixed is None else nnx.merge_state(trainable_out, fixed)
            opt_out = _keep_if(apply, new_opt, opt_state)
            if param_shardings is not None:
                policy_out = jax.lax.with_sharding_constraint(policy_out, param_shardings)
            if uses_critic:
                critic, critic_opt = _keep_if(apply, new_critic, critic), _keep_if(apply, new_critic_opt, critic_opt)
                if critic_shardings is not None:
                    critic = jax.lax.with_sharding_constraint(critic, critic_shardings)
            metrics.update(finite=finite, nonempty=nonempty, applied=apply, denominator=denominator)
            return policy_out, opt_out, critic, critic_opt, metrics

        self._experience = jax.jit(_learner_experience)
        self._train_step = jax.jit(_learner_train_step, donate_argnums=(0, 1, 2, 3) if config.donate else ())
        self._advantages = jax.jit(
            functools.partial(adv_lib.compute_advantages, config.advantage_estimator, **self._estimator_options())
        )

    def _estimator_options(self) -> dict[str, Any]:
        config = self.config
        wanted = dict(
            normalize_std=config.normalize_std, gamma=config.gamma, lam=config.lam, whiten=config.whiten_advantages,
            kl_coef=config.kl_coef if config.kl_in_reward else 0.0,
        )
        accepted = self._estimator.options()
        return {k: v for k, v in wanted.items() if k in accepted}

    def _commit(self, tree: Any) -> Any:
        """Pins every array to its device(s), so jit sees the same argument placement on every call."""
        device = None if self.mesh is not None else jax.devices()[0]
        return jax.tree.map(lambda x: jax.device_put(x, device or x.sharding), tree)

    def _shardings(self, tree: Any) -> Any:
        if self.mesh is None or tree is None:
            return None
        return jax.tree.map(lambda x: x.sharding, tree)

    def _put(self, array: np.ndarray, stacked: bool) -> Array:
        """Places a host array with its rows split over the mesh's batch axes (leading micro-batch axis kept)."""
        if self.mesh is None:
            return jnp.asarray(array)
        rows = (None,) if stacked else ()
        spec = P(*rows, sharding.BATCH, *([None] * (array.ndim - len(rows) - 1)))
        return jax.device_put(array, NamedSharding(self.mesh, spec))

    # ---------------------------------------------------------------------------------------- sizes and checks

    def _sizes(self, batch: TrajectoryBatch) -> tuple[int, int]:
        rows = batch.num_rows
        minibatch = self.config.minibatch_size or rows
        micro = self.config.microbatch_size or minibatch
        if rows % minibatch:
            raise BatchError(
                f"the batch has {rows} rows, not a multiple of minibatch_size={minibatch}; pad it with "
                f"batch.pad_rows({-(-rows // minibatch) * minibatch}) (padding rows have valid=0) or change "
                "minibatch_size"
            )
        if minibatch % micro:
            raise BatchError(f"minibatch of {minibatch} rows is not a multiple of microbatch_size={micro}")
        if self.mesh is not None:
            try:
                sharding.check_batch_fits_mesh(micro, self.mesh)
            except ConfigError as error:
                raise BatchError(f"micro-batch size: {error}") from None
        return minibatch, micro

    def _check(self, batch: TrajectoryBatch) -> np.ndarray:
        batch.validate()
        mask = batch.effective_loss_mask()
        if not (mask > 0).any():
            raise BatchError(
                "the batch's loss mask is all zero (after dropping valid=0 rows): it has no agent tokens to train "
                "on; check that the rollout marks the agent's sampled tokens with loss_mask=1"
            )
        try:
            adv_lib.check_estimator_inputs(self.config.advantage_estimator, np.asarray(batch.group_ids), mask)
        except adv_lib.AdvantageError as error:
            raise BatchError(str(error)) from None
        return mask

    # ---------------------------------------------------------------------------------------- experience

    def prepare(self, batch: TrajectoryBatch) -> dict[str, np.ndarray]:
        """The per-token training inputs of a batch (host arrays [B, T], or [B] for ``scores``).

        ``loss_mask`` (padding rows zeroed), ``old_logp``, ``ref_logp``, ``old_values`` (critic), ``advantages``,
        ``returns``. Runs the experience forward one micro-batch at a time, then the estimator on the whole batch.
        """
        batch = batch.to_numpy()
        mask = self._check(batch)
        _, micro = self._sizes(batch)
        tokens = batch.tokens
        positions = agent_positions(mask)
        parts: dict[str, list[np.ndarray]] = {}
        with sharding.use_mesh(self.mesh):
            for start in range(0, batch.num_rows, micro):
                rows = slice(start, start + micro)
                out = self._experience(self._policy, self._reference, self._critic, self._put(tokens[rows], False),
                                       self._put(positions[rows], False))
                for key, value in jax.device_get(out).items():
                    parts.setdefault(key, []).append(np.asarray(value))
        experience = {k: np.concatenate(v) for k, v in parts.items()}
        on = mask > 0
        old_logp = np.where(on, experience.get("old_logp", batch.old_logp), 0.0).astype(np.float32)
        fields: dict[str, Any] = dict(
            scores=batch.scores, loss_mask=mask, group_ids=batch.group_ids, old_logp=old_logp,
        )
        if "ref_logp" in experience:
            fields["ref_logp"] = np.where(on, experience["ref_logp"], 0.0).astype(np.float32)
        if "values" in experience:
            fields["values"] = np.where(on, experience["values"], 0.0).astype(np.float32)
        with sharding.use_mesh(self.mesh):
            advantages, returns = jax.device_get(self._advantages(**fields))
        prepared = dict(tokens=tokens, positions=positions, loss_mask=mask, old_logp=old_logp, advantages=np.asarray(advantages),
                        returns=np.asarray(returns), scores=batch.scores, valid=batch.valid)
        if "ref_logp" in fields:
            prepared["ref_logp"] = fields["ref_logp"]
        if "values" in fields:
            prepared["old_values"] = fields["values"]
        return prepared

    # ---------------------------------------------------------------------------------------- update

    def _minibatch_order(self, rng: jax.Array, valid_rows: np.ndarray, num_minibatches: int) -> list[np.ndarray]:
        """Row indices of each minibatch: real rows shuffled and dealt round-robin, then padding rows."""
        seed = np.asarray(jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng)
        generator = np.random.default_rng(seed.astype(np.uint32).ravel().tolist())
        real = np.flatnonzero(valid_rows)
        padding = np.flatnonzero(~valid_rows)
        order = np.concatenate([generator.permutation(real), generator.permutation(padding)])
        return [np.sort(order[i::num_minibatches]) for i in range(num_minibatches)]

    def update(self, batch: TrajectoryBatch, rng: jax.Array) -> dict[str, float]:
        """Trains on one rollout batch: ``ppo_epochs`` shuffled passes of minibatch updates. Returns metrics."""
        started = time.perf_counter()
        prepared = self.prepare(batch)
        minibatch, micro = self._sizes(batch)
        rows, length = prepared["tokens"].shape
        num_minibatches = rows // minibatch
        real_rows = prepared["loss_mask"].any(axis=-1)
        fields = POLICY_FIELDS + tuple(k for k in ("ref_logp",) if k in prepared)
        if self.config.uses_critic:
            fields = fields + ("old_values", "returns")
        step_metrics = []
        with sharding.use_mesh(self.mesh):
            for epoch in range(self.config.ppo_epochs):
                order = self._minibatch_order(jax.random.fold_in(rng, epoch), real_rows, num_minibatches)
                for index in order:
                    stack = {
                        k: self._put(prepared[k][index].reshape(minibatch // micro, micro, *prepared[k].shape[1:]), True)
                        for k in fields
                    }
                    self._policy, self._opt_state, self._critic, self._critic_opt, metrics = self._train_step(
                        self._policy, self._opt_state, self._critic, self._critic_opt, stack, jnp.int32(self._step)
                    )
                    applied = bool(metrics["applied"])
                    self._step += int(applied)
                    step_metrics.append(jax.device_get(metrics))
        self._updates_called += 1
        elapsed = time.perf_counter() - started
        result = self._summarize(step_metrics, prepared, elapsed, rows * length, minibatch)
        if result["skipped_updates"]:
            log.warning(
                "skipped %d of %d optimizer updates: non-finite loss or gradient (parameters left unchanged)",
                int(result["skipped_updates"]), len(step_metrics),
            )
        return result

    def _summarize(
        self, step_metrics: list[dict[str, Any]], prepared: dict[str, np.ndarray], elapsed: float,
        positions_per_epoch: int, minibatch: int,
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        applied = [m for m in step_metrics if m["applied"]]
        used = applied or step_metrics
        tokens = sum(float(m["sum/tokens"]) for m in used)
        for key in used[0]:
            if key.startswith("sum/") and key != "sum/tokens":
                metrics[key[4:]] = sum(float(m[key]) for m in used) / max(tokens, 1.0)
            elif key.startswith("max/"):
                metrics[f"{key[4:]}_max"] = max(float(m[key]) for m in used)
        for key in ("policy_loss", "kl_loss", "entropy_loss", "total_loss", "value_loss", "grad_norm",
                    "critic_grad_norm"):
            if key in used[0]:
                metrics[key] = float(np.mean([float(m[key]) for m in used]))
        if "value_error" in metrics:
            metrics["value_rmse"] = math.sqrt(metrics.pop("value_error"))
        metrics["grad_norm_max"] = float(max(float(m["grad_norm"]) for m in used))
        # The first minibatch is scored at the parameters that sampled the batch: its ratio is ~1 and its
        # log-prob gap ~0 unless the sampler and the learner disagree (precision, template, masking bugs).
        first = step_metrics[0]
        first_tokens = max(float(first["sum/tokens"]), 1.0)
        metrics["first_minibatch/ratio"] = float(first["sum/ratio"]) / first_tokens
        metrics["first_minibatch/abs_logp_gap"] = float(first["sum/abs_logp_gap"]) / first_tokens
        metrics["first_minibatch/ratio_max"] = float(first["max/ratio"])
        metrics["lr"] = float(step_metrics[-1]["lr"])
        if "critic_lr" in step_metrics[-1]:
            metrics["critic_lr"] = float(step_metrics[-1]["critic_lr"])
        metrics["skipped_updates"] = float(sum(1 for m in step_metrics if m["nonempty"] and not m["finite"]))
        metrics["empty_minibatches"] = float(sum(1 for m in step_metrics if not m["nonempty"]))
        metrics["optimizer_updates"] = float(len(applied))
        metrics["step"] = float(self._step)
        mask = prepared["loss_mask"]
        on = mask > 0
        for label in ("advantages", "returns"):
            values = prepared[label][on]
            metrics[f"{label}/abs_mean"] = float(np.abs(values).mean())
            metrics.update({f"{label}/mean": float(values.mean()), f"{label}/std": float(values.std()),
                            f"{label}/max": float(values.max()), f"{label}/min": float(values.min())})
        real = prepared["valid"] > 0
        scores = prepared["scores"][real]
        metrics["scores/mean"] = float(scores.mean())
        metrics["scores/std"] = float(scores.std())
        metrics["trajectories"] = float(real.sum())
        agent_tokens = float(mask.sum())
        metrics["agent_tokens"] = agent_tokens
        epochs = self.config.ppo_epochs
        metrics["update_seconds"] = elapsed
        metrics["tokens_per_s"] = positions_per_epoch * epochs / elapsed
        metrics["agent_tokens_per_s"] = agent_tokens * epochs / elapsed
        return metrics

    # ---------------------------------------------------------------------------------------- gradients (debug)

    def gradients(self, batch: TrajectoryBatch) -> tuple[nnx.State, dict[str, float]]:
        """The policy gradient of the whole batch as one minibatch at the current parameters (no update).

        Uses the train step's own accumulation over micro-batches of ``microbatch_size`` rows; for checks.
        """
        prepared = self.prepare(batch)
        _, micro = self._sizes(batch)
        rows = batch.num_rows
        fields = POLICY_FIELDS + tuple(k for k in ("ref_logp",) if k in prepared)
        if self._gradients_program is None:
            config, graphdef = self.config, self._train_graphdef

            def _learner_gradients(policy: Any, stack: dict[str, Array]) -> tuple[Any, dict[str, Array]]:
                mask = stack["loss_mask"]
                denominator = loss_denominator(config.loss_aggregation, mask.reshape(-1, mask.shape[-1]))
                loss_fn = functools.partial(policy_loss, config=config)
                trainable, fixed = self._trainable(policy)
                return _accumulated_grads(loss_fn, graphdef, trainable, stack, denominator, fixed)

            self._gradients_program = jax.jit(_learner_gradients)
        with sharding.use_mesh(self.mesh):
            stack = {k: self._put(prepared[k].reshape(rows // micro, micro, *prepared[k].shape[1:]), True) for k in fields}
            grads, aux = self._gradients_program(self._policy, stack)
        return grads, {k: float(v) for k, v in jax.device_get(aux).items()}

    # ---------------------------------------------------------------------------------------- checkpoints

    def _trainable(self, policy: nnx.State) -> tuple[nnx.State, nnx.State | None]:
        """(what the optimizer trains, the rest): (adapters, base weights) under LoRA, else (policy, None)."""
        if not self._lora:
            return policy, None
        return nnx.split_state(policy, lora.LoRAParam, ...)

    def _trees(self) -> dict[str, Any]:
        # Under LoRA a checkpoint holds the adapters and their optimizer state; the base comes from model.path.
        trees = {"policy": self._trainable(self._policy)[0], "policy_opt": self._opt_state}
        if self._reference is not None:
            trees["reference"] = self._reference
        if self._critic is not None:
            trees["critic"], trees["critic_opt"] = self._critic, self._critic_opt
        return trees

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything for an exact resume, as a flat ``{name: array}`` dict (orbax-friendly).

        Keys are ``<part>/<dotted path>`` for the policy, its optimizer state, the reference policy and the
        critic with its optimizer state, plus ``step``. The arrays are the live ones (save before the next update
        when ``donate=True``).
        """
        flat: dict[str, Any] = {}
        for part, tree in self._trees().items():
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                flat[f"{part}/{sharding.path_to_str(path)}"] = leaf
        flat["step"] = np.asarray(self._step, np.int64)
        return flat

    def restore_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`checkpoint_state` returned (arrays placed with the current shardings)."""
        expected = self.checkpoint_state()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise CheckpointError(
                f"learner checkpoint does not match this learner: missing {missing[:5]} ({len(missing)}), "
                f"unexpected {unexpected[:5]} ({len(unexpected)}); restore with the same LearnerConfig "
                "(estimator, use_reference) and model"
            )
        restored = {}
        for part, tree in self._trees().items():
            paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
            leaves = []
            for path, current in paths_leaves:
                key = f"{part}/{sharding.path_to_str(path)}"
                value = state[key]
                if tuple(np.shape(value)) != tuple(current.shape):
                    raise CheckpointError(f"{key} has shape {np.shape(value)} in the checkpoint, expected {current.shape}")
                value = np.asarray(jax.device_get(value)).astype(current.dtype) if not isinstance(value, jax.Array) else value.astype(current.dtype)
                leaves.append(jax.device_put(value, current.sharding))
            restored[part] = jax.tree_util.tree_unflatten(treedef, leaves)
        policy = restored["policy"]
        if self._lora:
            policy = nnx.merge_state(policy, self._trainable(self._policy)[1])
        self._policy, self._opt_state = policy, restored["policy_opt"]
        self._reference = restored.get("reference")
        if self._critic is not None:
            self._critic, self._critic_opt = restored["critic"], restored["critic_opt"]
        self._step = int(np.asarray(state["step"]))
