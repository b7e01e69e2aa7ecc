"""The learner's settings (:class:`LearnerConfig`, each default and check in one place) and its optimizer."""

from __future__ import annotations

import dataclasses
import importlib
import typing
from typing import Any, Mapping

import ml_collections
import optax

from agentgym_jax import advantages as adv_lib
from agentgym_jax import losses
from agentgym_jax.errors import ConfigError
from agentgym_jax.model import to_dtype

LR_SCHEDULES = ("constant", "cosine", "linear")
OLD_LOGP_SOURCES = ("recompute", "sampler")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Hyperparameters of the learner. Defaults are the original AgentGym-RL GRPO recipe.

    Sizes: ``minibatch_size`` trajectories per optimizer update (None: the whole batch), split into micro-batches
    of ``microbatch_size`` rows for gradient accumulation (None: no accumulation). Both count rows, padding rows
    included; the batch's rows must be a multiple of ``minibatch_size`` (pad with ``TrajectoryBatch.pad_rows``).
    """

    # algorithms: registered names (advantages.ESTIMATORS, losses.POLICY_LOSSES) and their own options; an
    # option not given in *_options comes from the field of the same name below, else the function's default
    advantage_estimator: str = "grpo"
    estimator_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    policy_loss: str = "ppo_clip"
    loss_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    import_modules: tuple[str, ...] = ()  # modules that register further estimators or losses, imported first
    normalize_std: bool = True  # grpo, gigpo: divide by the group std (False: Dr. GRPO)
    gamma: float = 1.0  # reinforce_pp, gae
    lam: float = 1.0  # gae
    whiten_advantages: bool = True  # gae
    # DAPO's overlong shaping (off when overlong_buffer == 0): a trajectory with L agent tokens above
    # overlong_max_tokens - overlong_buffer loses overlong_penalty * (L - that) / overlong_buffer (at most the penalty)
    overlong_buffer: int = 0
    overlong_max_tokens: int = 0
    overlong_penalty: float = 1.0
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
    # packed rows (agentgym_jax.packing): within a minibatch, the members of a group share one copy of their prompt
    # and trajectories share rows as long as the padded ones; a micro-batch holds at most microbatch_size of them
    pack_rows: bool = False
    # True: minibatches take whole groups (groups shuffled, not rows), so a packed minibatch holds each group's
    # shared prompt once instead of once per group member it happens to draw
    group_minibatches: bool = False
    # critic (gae only)
    value_clip: float | None = 0.5
    critic_learning_rate: float = 1e-5
    critic_warmup_steps: int = 0
    # numerics and memory
    compute_dtype: str | None = None  # None: the model's; 'bfloat16' with float32 params = mixed precision
    remat: bool | None = None  # None: the model's setting
    trainable_layers: int = 0  # train only the top N decoder layers (+ final norm and head); 0 = all layers
    # Keep the token embeddings fixed (and so a tied output head). With trainable_layers, the frozen layers' output
    # then stays fixed through a step: it is computed once per step, not in every update's forward pass.
    freeze_embeddings: bool = False
    donate: bool = True  # update parameter and optimizer buffers in place

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs a value model."""
        return adv_lib.get_estimator(self.advantage_estimator).uses_critic

    @property
    def reward_kl_coef(self) -> float:
        """The KL coefficient token-level estimators put in the reward (0 unless ``kl_in_reward``)."""
        return self.kl_coef if self.kl_in_reward else 0.0

    def resolved_estimator_options(self) -> dict[str, Any]:
        """The estimator's option values for this run (see the field comment)."""
        return adv_lib.get_estimator(self.advantage_estimator).resolve_options(
            self.estimator_options, self, "advantage estimator")

    def resolved_loss_options(self) -> dict[str, Any]:
        """The policy loss's option values for this run."""
        return losses.POLICY_LOSSES.get(self.policy_loss).resolve_options(self.loss_options, self, "policy loss")

    @property
    def kl_loss_active(self) -> bool:
        """Whether the KL to the reference is a term of the policy loss."""
        return self.kl_coef != 0.0 and not self.kl_in_reward

    def validate(self) -> None:
        """Raises :class:`ConfigError` naming the field for an unknown name or an out-of-range value."""
        import_algorithm_modules(self.import_modules)
        try:
            estimator = adv_lib.get_estimator(self.advantage_estimator)
        except adv_lib.AdvantageError as error:
            raise ConfigError(f"advantage_estimator: {error}") from None
        for field, resolve in (("estimator_options", self.resolved_estimator_options),
                               ("loss_options", self.resolved_loss_options)):
            try:
                resolve()
            except ConfigError as error:
                raise ConfigError(f"{field}: {error}") from None
        if self.overlong_buffer:
            _at_least("overlong_buffer", self.overlong_buffer, 0)
            if self.overlong_max_tokens <= self.overlong_buffer:
                raise ConfigError(f"overlong_max_tokens ({self.overlong_max_tokens}) must exceed overlong_buffer "
                                  f"({self.overlong_buffer}) when overlong shaping is on")
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
        if self.kl_in_reward and self.kl_coef > 0 and "reward_kl_coef" not in estimator.options():
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
        if self.pack_rows:
            self._check_packable()
        if self.trainable_layers and self.uses_critic:
            raise ConfigError("trainable_layers applies to the policy only; with advantage_estimator='gae' the critic "
                              "would train all layers. Set trainable_layers=0 or use a critic-free estimator")


    def _check_packable(self) -> None:
        # A loss that reads the loss mask itself (gspo) or a per-sequence aggregation treats each row as one
        # trajectory; a critic scores every position of its rows. Neither reads packed rows correctly.
        if self.loss_aggregation != "token-mean":
            raise ConfigError(f"pack_rows=True needs loss_aggregation='token-mean' (got {self.loss_aggregation!r}: "
                              "it averages per row, and a packed row holds several trajectories); set pack_rows=False")
        if "loss_mask" in losses.POLICY_LOSSES.get(self.policy_loss).requires:
            raise ConfigError(f"pack_rows=True needs a token-level policy loss; {self.policy_loss!r} computes "
                              "sequence-level ratios per row. Set pack_rows=False or policy_loss='ppo_clip'")
        if self.uses_critic:
            raise ConfigError("pack_rows=True works with critic-free estimators (grpo, rloo, reinforce_pp, gigpo); "
                              "set pack_rows=False for advantage_estimator='gae'")


def import_algorithm_modules(modules: tuple[str, ...]) -> None:
    """Imports modules that register estimators or losses; a missing one is a one-line ConfigError."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            raise ConfigError(f"import_modules: cannot import {module!r} ({error}); is it on PYTHONPATH?") from None


# Fields the run config does not hold in ``algo``: the trainer sets them from other sections (train.steps,
# model.dtype, model.remat) or keeps the learner's own behaviour (donation).
NOT_IN_RUN_CONFIG = ("total_steps", "compute_dtype", "remat", "donate")


def run_config_section() -> ml_collections.ConfigDict:
    """The run config's ``algo`` section, built from :class:`LearnerConfig`: every setting with its default.

    Settings whose default is None are typed references, so ``--config.algo.minibatch_size=64`` parses.
    """
    hints = typing.get_type_hints(LearnerConfig)
    section = ml_collections.ConfigDict()
    for field in dataclasses.fields(LearnerConfig):
        if field.name in NOT_IN_RUN_CONFIG:
            continue
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        if default is None:
            value_type = next(t for t in typing.get_args(hints[field.name]) if t is not type(None))
            section[field.name] = ml_collections.FieldReference(None, field_type=value_type)
        elif isinstance(default, Mapping):
            section[field.name] = ml_collections.ConfigDict(dict(default))
        else:
            section[field.name] = default
    return section


def from_run_config_section(section: Mapping[str, Any], **overrides: Any) -> LearnerConfig:
    """A validated :class:`LearnerConfig` from a run config's ``algo`` section (plus trainer-set ``overrides``)."""
    fields = {f.name for f in dataclasses.fields(LearnerConfig)} - set(NOT_IN_RUN_CONFIG)
    values = section.to_dict() if isinstance(section, ml_collections.ConfigDict) else dict(section)
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"algo.{unknown[0]} is not a learner setting; valid keys: {', '.join(sorted(fields))}")
    for key, value in values.items():
        if isinstance(value, list):
            values[key] = tuple(value)
    config = LearnerConfig(**values, **overrides)
    try:
        config.validate()
    except ConfigError as error:
        raise ConfigError(f"algo.{error}") from None
    return config


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


