"""Per-token RL losses and their exact aggregation, as pure, jit-compatible jax.numpy functions.

Per-token functions return ``[B, T]`` arrays and know nothing about the mask; :func:`aggregate_loss` applies the
loss mask and returns ``(numerator, denominator)`` so gradient accumulation is exact: the trainer sums the
numerators of its micro-batches, sums their denominators, and divides once. Positions outside the mask are
selected away (``jnp.where``), so their values never reach the loss; inputs there must still be finite for
gradients to stay finite.

Sign convention: every loss here is minimized. The policy loss is ``-A * ratio``; an entropy *bonus* is
``-entropy_coef * entropy`` in the trainer's total.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax.mixed_matmul import mixed_dot
from agentgym_jax.registry import Registry

Array = jax.Array
# Policy losses: f(logp, old_logp, advantages, loss_mask, **options) -> PolicyLossTerms, registered by name.
POLICY_LOSSES: Registry = Registry("policy loss", inputs=("logp", "old_logp", "advantages", "loss_mask"))
register_policy_loss = POLICY_LOSSES.register

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


class LossConfigError(ValueError):
    """Raised for an unknown loss/aggregation/KL name or an invalid loss hyperparameter."""


# --------------------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------------------


def _masked(loss: Array, loss_mask: Array) -> tuple[Array, Array]:
    on = loss_mask > 0
    return jnp.where(on, loss, 0.0).astype(jnp.float32), on.astype(jnp.float32)


def token_mean_parts(loss: Array, loss_mask: Array) -> tuple[Array, Array]:
    """``(sum of loss over mask tokens, number of mask tokens)``: every agent token weighs the same."""
    values, on = _masked(loss, loss_mask)
    return jnp.sum(values), jnp.sum(on)


def seq_mean_token_mean_parts(loss: Array, loss_mask: Array) -> tuple[Array, Array]:
    """``(sum over rows of each row's token-mean, number of rows with a mask token)``: every trajectory
    weighs the same, whatever its length."""
    values, on = _masked(loss, loss_mask)
    tokens = jnp.sum(on, axis=-1)
    row_means = jnp.sum(values, axis=-1) / jnp.maximum(tokens, 1.0)
    return jnp.sum(row_means), jnp.sum(tokens > 0).astype(jnp.float32)


def seq_mean_token_sum_parts(loss: Array, loss_mask: Array) -> tuple[Array, Array]:
    """``(sum of loss over mask tokens, number of rows with a mask token)``: each row's token-sum, averaged
    over rows."""
    values, on = _masked(loss, loss_mask)
    return jnp.sum(values), jnp.sum(jnp.sum(on, axis=-1) > 0).astype(jnp.float32)


LOSS_AGGREGATIONS: dict[str, Callable[[Array, Array], tuple[Array, Array]]] = {
    "token-mean": token_mean_parts,
    "seq-mean-token-mean": seq_mean_token_mean_parts,
    "seq-mean-token-sum": seq_mean_token_sum_parts,
}


def get_aggregation(name: str) -> Callable[[Array, Array], tuple[Array, Array]]:
    """The aggregation registered as ``name``; raises :class:`LossConfigError` listing the valid names."""
    try:
        return LOSS_AGGREGATIONS[name]
    except KeyError:
        raise LossConfigError(
            f"Unknown loss aggregation {name!r}; valid names: {', '.join(sorted(LOSS_AGGREGATIONS))}."
        ) from None


def aggregate_loss(name: str, loss: Array, loss_mask: Array) -> tuple[Array, Array]:
    """``(numerator, denominator)`` of ``loss`` [B, T] under aggregation ``name`` over ``loss_mask``."""
    return get_aggregation(name)(loss, loss_mask)


def masked_token_mean(x: Array, loss_mask: Array) -> Array:
    """Mean of ``x`` over mask tokens (0 for an empty mask); for metrics such as clip fraction."""
    total, count = token_mean_parts(x, loss_mask)
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


# --------------------------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyLossTerms:
    """Per-token PPO-clip outputs, all ``[B, T]`` float32.

    ``clipped``: 1 where the clipped surrogate was the active (larger) loss; ``dual_clipped``: 1 where the
    dual-clip bound ``-A * clip_ratio_c`` capped the loss (negative advantages only); ``log_ratio``: the
    clamped ``logp - old_logp`` (its negative masked mean is the usual approximate KL metric).
    """

    loss: Array
    clipped: Array
    dual_clipped: Array
    ratio: Array
    log_ratio: Array


jax.tree_util.register_dataclass(
    PolicyLossTerms, data_fields=["loss", "clipped", "dual_clipped", "ratio", "log_ratio"], meta_fields=[]
)


def clamped_log_ratio(logp: Array, old_logp: Array) -> Array:
    """``logp - old_logp`` clamped to [-20, 20] (so ``exp`` cannot overflow), in float32."""
    return jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).astype(jnp.float32)


def clipped_surrogate(ratio: Array, advantages: Array, low: float, high: float) -> tuple[Array, Array]:
    """PPO's pessimistic surrogate ``max(-A r, -A clip(r, 1 - low, 1 + high))`` and where the clipped term won."""
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * jnp.clip(ratio, 1.0 - low, 1.0 + high)
    return jnp.maximum(unclipped_loss, clipped_loss), (clipped_loss > unclipped_loss).astype(jnp.float32)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    loss_mask: Array | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
) -> PolicyLossTerms:
    """PPO-clip per token: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` with ``r = exp(logp - old)``.

    With ``clip_ratio_c`` (> 1, e.g. 3.0) the loss of negative-advantage tokens is further capped at
    ``-A * clip_ratio_c`` (dual-clip). The log-ratio is clamped to [-20, 20] before ``exp``.
    """
    if clip_low < 0 or clip_high < 0:
        raise LossConfigError(f"clip_low and clip_high must be >= 0; got {clip_low}, {clip_high}.")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise LossConfigError(f"clip_ratio_c must be > 1 (e.g. 3.0) or None to disable dual-clip; got {clip_ratio_c}.")
    log_ratio = clamped_log_ratio(logp, old_logp)
    ratio = jnp.exp(log_ratio)
    advantages = advantages.astype(jnp.float32)
    loss, clipped = clipped_surrogate(ratio, advantages, clip_low, clip_high)
    dual_clipped = jnp.zeros_like(loss)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        negative = advantages < 0
        dual_clipped = (negative & (loss > bound)).astype(jnp.float32)
        loss = jnp.where(negative, jnp.minimum(loss, bound), loss)
    return PolicyLossTerms(loss, clipped, dual_clipped, ratio, log_ratio)


@register_policy_loss("gspo", requires=("loss_mask",))
def gspo_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    seq_clip_low: float = 3e-4,
    seq_clip_high: float = 4e-4,
) -> PolicyLossTerms:
    """GSPO (Zheng et al., 2025) in its token form: one importance ratio per trajectory,
    ``s = exp(mean over its agent tokens of (logp - old_logp))``, clipped to ``[1 - low, 1 + high]`` in a PPO-clip
    surrogate. Each token's ratio is ``sg(s) * p / sg(p)``: its value is ``s`` and its gradient ``s * grad log p``,
    so with per-trajectory advantages and ``seq-mean-token-mean`` aggregation this is GSPO's sequence objective.
    """
    on = loss_mask > 0
    token_log_ratio = clamped_log_ratio(logp, old_logp)
    count = jnp.maximum(jnp.sum(on, axis=-1, keepdims=True), 1)
    seq_log_ratio = jnp.sum(jnp.where(on, token_log_ratio, 0.0), axis=-1, keepdims=True) / count
    log_ratio = jax.lax.stop_gradient(seq_log_ratio) + logp - jax.lax.stop_gradient(logp)
    ratio = jnp.exp(log_ratio.astype(jnp.float32))
    loss, clipped = clipped_surrogate(ratio, advantages.astype(jnp.float32), seq_clip_low, seq_clip_high)
    return PolicyLossTerms(loss, clipped, jnp.zeros_like(loss), ratio, jnp.broadcast_to(seq_log_ratio, loss.shape))


@register_policy_loss("cispo")
def cispo_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    loss_mask: Array | None = None,
    *,
    is_eps_low: float = 1.0,
    is_eps_high: float = 4.0,
) -> PolicyLossTerms:
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1 - is_eps_low, 1 + is_eps_high)) * A * logp`` per token.

    The importance weight is clipped and detached instead of the update being cut, so every token keeps a
    gradient (``A * weight * grad log p``). The defaults leave no lower bound (``1 - 1 = 0``) and cap the weight
    at 5. ``clipped`` marks tokens whose weight was clipped.
    """
    log_ratio = clamped_log_ratio(logp, old_logp)
    ratio = jnp.exp(log_ratio)
    weight = jnp.clip(ratio, 1.0 - is_eps_low, 1.0 + is_eps_high)
    loss = -jax.lax.stop_gradient(weight) * advantages.astype(jnp.float32) * logp.astype(jnp.float32)
    clipped = (weight != ratio).astype(jnp.float32)
    return PolicyLossTerms(loss, clipped, jnp.zeros_like(loss), ratio, log_ratio)


# --------------------------------------------------------------------------------------------------------------
# KL to the reference policy
# --------------------------------------------------------------------------------------------------------------


def kl_k1(logp: Array, ref_logp: Array) -> Array:
    """k1: ``logp - ref_logp`` (unbiased, high variance; the usual reward-penalty form)."""
    return (logp - ref_logp).astype(jnp.float32)


def kl_k2(logp: Array, ref_logp: Array) -> Array:
    """k2: ``0.5 * (logp - ref_logp)^2``."""
    return 0.5 * jnp.square(logp - ref_logp).astype(jnp.float32)


def kl_k3(logp: Array, ref_logp: Array) -> Array:
    """k3 (low-variance): ``exp(ref - logp) - (ref - logp) - 1``, clamped to [-10, 10].

    ``ref - logp`` is clamped to [-20, 20] before ``exp`` so it cannot overflow; this never changes the
    result, which is already clamped to 10 there.
    """
    diff = jnp.clip(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).astype(jnp.float32)
    return jnp.clip(jnp.exp(diff) - diff - 1.0, -K3_CLAMP, K3_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[Array, Array], Array]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> Callable[[Array, Array], Array]:
    """The KL estimator registered as ``name``; raises :class:`LossConfigError` listing the valid names."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise LossConfigError(f"Unknown KL estimator {name!r}; valid names: {', '.join(sorted(KL_ESTIMATORS))}.") from None


def kl_divergence(name: str, logp: Array, ref_logp: Array) -> Array:
    """Per-token KL(policy || reference) estimate ``[B, T]`` with estimator ``name`` (k1, k2, k3)."""
    return get_kl_estimator(name)(logp, ref_logp)


# --------------------------------------------------------------------------------------------------------------
# Log-probs and entropy
# --------------------------------------------------------------------------------------------------------------


def _finite_or_zero(logits: Array) -> Array:
    return jnp.where(jnp.isfinite(logits), logits, 0.0)


def entropy_from_logits(logits: Array) -> Array:
    """Entropy ``-sum(p * log p)`` of ``softmax(logits)`` over the last axis, in float32.

    Uses the max-shifted log-softmax (no cancellation for peaked distributions) and is finite, in value and
    gradient, for large logits and for ``-inf`` entries (banned tokens). The learner calls the one-pass
    :func:`logprobs_and_entropy`; this autodiff form is its reference (tests compare the two).
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    probs = jnp.exp(log_probs)
    return -jnp.sum(probs * _finite_or_zero(log_probs), axis=-1)


def logprobs_from_logits(logits: Array, targets: Array) -> Array:
    """``log softmax(logits)[target]`` per position, in float32 (``logits`` [..., V], ``targets`` [...]); the
    autodiff reference of :func:`logprobs_and_entropy`, which the learner calls."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


@jax.custom_vjp
def logprobs_and_entropy(logits: Array, targets: Array) -> tuple[Array, Array]:
    """``(logprobs_from_logits, entropy_from_logits)`` of ``logits`` [..., V], with the same values and gradients,
    in fewer passes over the vocabulary: composing the two had XLA evaluate three exponentials over [rows, V]
    forward and more in the backward pass (a tenth of a CPU training step); here the backward pass takes one
    and keeps only the shifted logits from the forward pass."""
    return _logprobs_and_entropy_forward(logits, targets)[0]


def _logprobs_and_entropy_forward(logits: Array, targets: Array):
    logits = logits.astype(jnp.float32)
    top = jnp.max(logits, axis=-1, keepdims=True)
    shifted = logits - jnp.where(jnp.isfinite(top), top, 0.0)
    exponentials = jnp.exp(shifted)
    total = jnp.sum(exponentials, axis=-1, keepdims=True)
    log_total = jnp.log(total)
    # -sum(p log p) = log(total) - sum(e * shifted) / total; a banned (-inf) entry has e = 0 and adds nothing
    entropy = (log_total - jnp.sum(exponentials * _finite_or_zero(shifted), axis=-1, keepdims=True) / total)[..., 0]
    picked = (jnp.take_along_axis(shifted, targets[..., None].astype(jnp.int32), axis=-1) - log_total)[..., 0]
    return (picked, entropy), (shifted, log_total, entropy, targets)


def _logprobs_and_entropy_backward(residuals, cotangents):
    shifted, log_total, entropy, targets = residuals
    d_logp, d_entropy = cotangents
    log_probs = shifted - log_total
    probs = jnp.exp(log_probs)
    # d logp[t] / d logits = onehot(t) - p;  d entropy / d logits = -p (log p + entropy)
    grad = -probs * (d_logp[..., None] + d_entropy[..., None] * (_finite_or_zero(log_probs) + entropy[..., None]))
    hit = targets[..., None].astype(jnp.int32) == jnp.arange(shifted.shape[-1], dtype=jnp.int32)
    return grad + jnp.where(hit, d_logp[..., None], 0.0), np.zeros(targets.shape, jax.dtypes.float0)


logprobs_and_entropy.defvjp(_logprobs_and_entropy_forward, _logprobs_and_entropy_backward)


def chunked_logprobs_and_entropy(
    hidden: Array, unembedding: Array, targets: Array, chunk_size: int
) -> tuple[Array, Array]:
    """Token log-probs and entropies from final hidden states without materializing ``[B, T, V]`` logits.

    ``hidden`` [B, T, D], ``unembedding`` [D, V], ``targets`` [B, T]; the time axis is processed ``chunk_size``
    positions at a time (``T`` must be a multiple of ``chunk_size``) and each chunk's logits are recomputed in
    the backward pass (``jax.checkpoint``), so peak memory is ``B * chunk_size * V`` floats. Returns
    ``(logp [B, T], entropy [B, T])`` in float32.
    """
    batch, length, _ = hidden.shape
    if chunk_size <= 0 or length % chunk_size:
        raise LossConfigError(
            f"chunk_size must be a positive divisor of the sequence length {length}; got {chunk_size}. "
            "Pad the batch to a multiple of chunk_size or pick a divisor."
        )
    num_chunks = length // chunk_size

    @jax.checkpoint
    def one_chunk(args: tuple[Array, Array]) -> tuple[Array, Array]:
        hidden_chunk, target_chunk = args
        return logprobs_and_entropy(mixed_dot(hidden_chunk, unembedding, out_dtype=jnp.float32), target_chunk)

    hidden_chunks = hidden.reshape(batch, num_chunks, chunk_size, -1).swapaxes(0, 1)
    target_chunks = targets.reshape(batch, num_chunks, chunk_size).swapaxes(0, 1)
    logp, entropy = jax.lax.map(one_chunk, (hidden_chunks, target_chunks))
    return logp.swapaxes(0, 1).reshape(batch, length), entropy.swapaxes(0, 1).reshape(batch, length)


# --------------------------------------------------------------------------------------------------------------
# Critic
# --------------------------------------------------------------------------------------------------------------


def clipped_value_loss(
    values: Array, old_values: Array, returns: Array, *, clip_range: float | None = 0.5
) -> tuple[Array, Array]:
    """Critic loss per token ``0.5 * max((V - R)^2, (clip(V, V_old - e, V_old + e) - R)^2)``.

    ``clip_range=None`` gives the plain ``0.5 * (V - R)^2``. Returns ``(loss, clipped)`` where ``clipped`` is
    1 where the clipped term was the larger one.
    """
    values = values.astype(jnp.float32)
    unclipped = jnp.square(values - returns)
    if clip_range is None:
        return 0.5 * unclipped, jnp.zeros_like(unclipped)
    if clip_range < 0:
        raise LossConfigError(f"clip_range must be >= 0 or None; got {clip_range}.")
    clipped_values = jnp.clip(values, old_values - clip_range, old_values + clip_range)
    clipped = jnp.square(clipped_values - returns)
    return 0.5 * jnp.maximum(unclipped, clipped), (clipped > unclipped).astype(jnp.float32)
