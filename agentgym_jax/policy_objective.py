"""The policy objective as pure functions: token log-probs (chunked, at agent positions), loss denominators, the
PPO-clip policy loss with KL and entropy terms, the critic's value loss, and exact gradient accumulation over
micro-batches. The learner's jitted train step and the tests use these very functions."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentgym_jax import losses
from agentgym_jax.buckets import bucket
from agentgym_jax.critic import Critic
from agentgym_jax.learner_config import LearnerConfig
from agentgym_jax.mixed_matmul import mixed_dot
from agentgym_jax.model import DecoderLM, Segments, to_dtype

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainingBatch:
    """What the train step reads, per row: the experience pass and the estimator's outputs over a
    :class:`~agentgym_jax.batch.TrajectoryBatch` (``[B, T]`` unless noted; ``[n, micro, ...]`` once stacked)."""

    tokens: Any
    positions: Any  # [B, K] agent-token positions (agent_positions), -1 padded
    loss_mask: Any  # padding rows zeroed
    old_logp: Any
    advantages: Any
    returns: Any
    scores: Any  # [B], after any reward shaping
    valid: Any  # [B]
    ref_logp: Any = None  # with a reference policy
    old_values: Any = None  # with a critic
    # Packed rows only (agentgym_jax.packing): where each scored token's predicting state sits [B, K], the RoPE
    # position of every token and the attention segments [B, T].
    sources: Any = None
    rope_positions: Any = None
    blocks: Any = None
    branches: Any = None
    # [B, T, D]: the hidden states after the frozen layers, computed once per step (DecoderLM.trunk) when those
    # layers and the embeddings are frozen; the train step then starts from them.
    trunk: Any = None

    @property
    def segments(self) -> Segments | None:
        return None if self.blocks is None else Segments(self.blocks, self.branches)

    def map(self, fn: Callable[[Any], Any]) -> "TrainingBatch":
        """Applies ``fn`` to every present field (e.g. row selection, stacking, device placement)."""
        return jax.tree.map(fn, self)


def to_token_positions(per_prediction: Array) -> Array:
    """Moves values computed at position t-1 (predicting token t) to position t; position 0 gets 0."""
    return jnp.pad(per_prediction[:, :-1], ((0, 0), (1, 0)))


def token_logprobs_from_logits(logits: Array, tokens: Array, temperature: float = 1.0) -> tuple[Array, Array]:
    """``(logp, entropy)`` [B, T] of each token under ``logits`` [B, T, V] read at the previous position."""
    logits = logits.astype(jnp.float32) / temperature
    targets = jnp.roll(tokens, -1, axis=1)
    logp, entropy = losses.logprobs_and_entropy(logits, targets)
    return to_token_positions(logp), to_token_positions(entropy)


def unembedding(model: DecoderLM) -> Array:
    """The output projection [D, V] in the compute dtype (the transposed embeddings when tied)."""
    dtype = to_dtype(model.config.dtype)
    if model.config.tie_word_embeddings:
        return model.model.embed_tokens.weight[...].astype(dtype).T
    return model.lm_head.kernel[...].astype(dtype)


AGENT_POSITION_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def agent_positions(loss_mask: np.ndarray, largest: int | None = None) -> np.ndarray:
    """``[B, K]`` int32 indices of each row's loss-mask tokens, padded with -1; K is a bucket of the largest count
    (or of ``largest``, e.g. the largest over all processes' rows).

    The learner reads log-probs only there, so the output head (a large share of a small model's compute) runs
    on K positions per row instead of T.
    """
    on = np.asarray(loss_mask) > 0
    if largest is None:
        largest = int(on.sum(axis=1).max(initial=0))
    width = bucket(max(1, largest), AGENT_POSITION_BUCKETS)
    positions = np.full((on.shape[0], width), -1, np.int32)
    for row, indices in enumerate(on):
        found = np.flatnonzero(indices)
        positions[row, : len(found)] = found
    return positions


def selected_logprobs(hidden: Array, tokens: Array, head: Array, positions: Array, temperature: float,
                      chunk_size: int | None = None, sources: Array | None = None) -> tuple[Array, Array]:
    """``(logp, entropy)`` [B, T] at ``positions`` [B, K] (-1 = none) from hidden states [B, T, D]; 0 elsewhere.

    The state that predicts the token at a position is the one just before it, or ``sources`` [B, K] (packed rows).
    """
    valid = positions > 0
    index = jnp.maximum(positions, 1)
    source = index - 1 if sources is None else jnp.maximum(sources, 0)
    before = jnp.take_along_axis(hidden, source[..., None], axis=1)  # the state that predicts each token
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
        logits = mixed_dot(before, head, out_dtype=jnp.float32)
        logp, entropy = losses.logprobs_and_entropy(logits, targets)
    logp, entropy = jnp.where(valid, logp, 0.0), jnp.where(valid, entropy, 0.0)
    rows = jnp.arange(tokens.shape[0])[:, None]
    scatter = lambda values: jnp.zeros(tokens.shape, jnp.float32).at[rows, index].add(values)
    return scatter(logp), scatter(entropy)


def token_logprobs(
    model: DecoderLM, tokens: Array, temperature: float = 1.0, chunk_size: int | None = None,
    positions: Array | None = None, packed: TrainingBatch | None = None,
) -> tuple[Array, Array]:
    """``(logp, entropy)`` [B, T] float32 of each token of ``tokens`` [B, T] (0 at position 0).

    With ``positions`` ([B, K] from :func:`agent_positions`) only those tokens are scored (0 elsewhere). With
    ``chunk_size`` the ``[B, T, V]`` logits are never materialized at once (see
    :func:`losses.chunked_logprobs_and_entropy`); ``T`` is padded internally to a multiple of it. ``packed`` (a
    packed batch: its sources, RoPE positions and segments) scores packed rows; it needs ``positions``. A batch
    given as ``packed`` with a ``trunk`` starts from it.
    """
    trunk = None if packed is None else packed.trunk
    if packed is not None and packed.blocks is not None:
        if positions is None:
            raise ValueError("packed rows are scored at agent positions only; pass positions")
        hidden, _ = model.forward(tokens, packed.rope_positions, segments=packed.segments, trunk=trunk)
        return selected_logprobs(hidden, tokens, unembedding(model), positions, temperature, chunk_size,
                                 packed.sources)
    hidden, _ = model.forward(tokens, trunk=trunk)
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
    logp: Array, entropy: Array, micro: TrainingBatch, denominator: Array, config: LearnerConfig
) -> tuple[Array, dict[str, Array]]:
    """The policy loss of one micro-batch, ``numerator / denominator``, from its token log-probs and entropies.

    The per-token policy loss is ``config.policy_loss`` from the registry (``losses.POLICY_LOSSES``) with its
    resolved options; the KL term (``ref_logp``) and the entropy bonus are added per token, then aggregated.
    ``denominator`` is that of the whole minibatch, so micro-batch losses and gradients simply add up. The aux
    dict holds each term's share of the minibatch loss and token sums for metrics.
    """
    mask = micro.loss_mask
    on = mask > 0
    aggregate = losses.get_aggregation(config.loss_aggregation)
    inverse = 1.0 / jnp.maximum(denominator, 1.0)
    loss_fn = losses.POLICY_LOSSES.get(config.policy_loss).fn
    terms = loss_fn(logp, micro.old_logp, micro.advantages, mask, **config.resolved_loss_options())
    total = terms.loss
    aux: dict[str, Array] = {"policy_loss": aggregate(terms.loss, mask)[0] * inverse}
    if config.kl_loss_active:
        kl = losses.kl_divergence(config.kl_estimator, logp, micro.ref_logp)
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
    aux["sum/approx_kl"] = token_sum(losses.kl_k3(logp, micro.old_logp))
    aux["sum/ratio"] = token_sum(terms.ratio)
    aux["sum/abs_logp_gap"] = token_sum(jnp.abs(logp - micro.old_logp))
    aux["max/ratio"] = jnp.max(jnp.where(on, terms.ratio, 0.0))
    aux["sum/entropy"] = token_sum(entropy)
    if micro.ref_logp is not None:
        aux["sum/ref_kl"] = token_sum(losses.kl_k3(logp, micro.ref_logp))
    aux["sum/tokens"] = jnp.sum(on.astype(jnp.float32))
    return loss, aux


def policy_loss(
    model: DecoderLM, micro: TrainingBatch, denominator: Array, config: LearnerConfig
) -> tuple[Array, dict[str, Array]]:
    """The train step's policy loss of one micro-batch (its log-probs at ``micro.positions``, then
    :func:`policy_loss_terms`)."""
    logp, entropy = token_logprobs(model, micro.tokens, config.temperature, config.logprob_chunk_size,
                                   micro.positions, packed=micro)
    return policy_loss_terms(logp, entropy, micro, denominator, config)


def value_loss(
    critic: Critic, micro: TrainingBatch, denominator: Array, config: LearnerConfig
) -> tuple[Array, dict[str, Array]]:
    """The clipped value loss of one micro-batch (``tokens``, ``loss_mask``, ``old_values``, ``returns``)."""
    mask = micro.loss_mask
    on = mask > 0
    values = critic.values(micro.tokens)
    per_token, clipped = losses.clipped_value_loss(values, micro.old_values, micro.returns,
                                                   clip_range=config.value_clip)
    loss = losses.aggregate_loss(config.loss_aggregation, per_token, mask)[0] / jnp.maximum(denominator, 1.0)
    aux = {
        "value_loss": loss,
        "sum/value_clip_frac": jnp.sum(jnp.where(on, clipped, 0.0)),
        "sum/values": jnp.sum(jnp.where(on, values, 0.0)),
        "sum/value_error": jnp.sum(jnp.where(on, jnp.square(values - micro.returns), 0.0)),
    }
    return loss, aux


def _accumulated_grads(
    loss_fn: Callable[..., tuple[Array, dict[str, Array]]],
    graphdef: Any,
    params: Any,
    stack: TrainingBatch,
    denominator: Array,
    fixed: Any = None,
) -> tuple[Any, dict[str, Array]]:
    """Sum over the leading micro-batch axis of ``stack`` of the gradient of ``loss_fn`` (exact accumulation),
    with respect to ``params`` only (``fixed``: the rest of the model's state, e.g. the base weights under LoRA)."""

    def grads_of(micro: TrainingBatch) -> tuple[Any, dict[str, Array]]:
        def loss_of(p: Any) -> tuple[Array, dict[str, Array]]:
            model = nnx.merge(graphdef, p) if fixed is None else nnx.merge(graphdef, p, fixed)
            return loss_fn(model, micro, denominator)

        (_, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        return grads, aux

    count = stack.tokens.shape[0]
    if count == 1:
        return grads_of(stack.map(lambda x: x[0]))

    def body(total: Any, micro: TrainingBatch) -> tuple[Any, dict[str, Array]]:
        grads, aux = grads_of(micro)
        return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), total, grads), aux

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    summed, aux = jax.lax.scan(body, zeros, stack)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), summed, params)
    return grads, {k: jnp.max(v, axis=0) if k.startswith("max/") else jnp.sum(v, axis=0) for k, v in aux.items()}


def _keep_if(ok: Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


