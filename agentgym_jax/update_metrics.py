"""The metrics of one learner update, summarized from its minibatch steps (see ``Learner.update``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from agentgym_jax.policy_objective import TrainingBatch


def summarize_update(
    step_metrics: list[dict[str, Any]], prepared: TrainingBatch, elapsed: float, positions_per_epoch: int,
    epochs: int,
) -> dict[str, float]:
    """One update's metrics from its minibatch steps' outputs: token-weighted means of the loss terms, the
    first minibatch's ratio and log-prob gap (scored at the sampling parameters), advantage/return/score
    statistics, counts and throughput."""
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
    mask = prepared.loss_mask
    on = mask > 0
    for label, per_token in (("advantages", prepared.advantages), ("returns", prepared.returns)):
        values = per_token[on]
        metrics[f"{label}/abs_mean"] = float(np.abs(values).mean())
        metrics.update({f"{label}/mean": float(values.mean()), f"{label}/std": float(values.std()),
                        f"{label}/max": float(values.max()), f"{label}/min": float(values.min())})
    real = prepared.valid > 0
    scores = prepared.scores[real]
    metrics["scores/mean"] = float(scores.mean())
    metrics["scores/std"] = float(scores.std())
    metrics["trajectories"] = float(real.sum())
    agent_tokens = float(mask.sum())
    metrics["agent_tokens"] = agent_tokens
    metrics["update_seconds"] = elapsed
    metrics["tokens_per_s"] = positions_per_epoch * epochs / elapsed
    metrics["agent_tokens_per_s"] = agent_tokens * epochs / elapsed
    return metrics
