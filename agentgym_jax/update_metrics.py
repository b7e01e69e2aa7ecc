"""The metrics of one learner update, summarized from its minibatch steps (see ``Learner.update``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from agentgym_jax.policy_objective import TrainingBatch


def batch_stats(prepared: TrainingBatch) -> dict[str, float]:
    """Sums, counts and extremes of a (process's part of a) prepared batch: advantages and returns over agent
    tokens, scores over real trajectories. :func:`merge_batch_stats` combines several processes' parts."""
    on = prepared.loss_mask > 0
    stats: dict[str, float] = {}
    for label, per_token in (("advantages", prepared.advantages), ("returns", prepared.returns)):
        values = np.asarray(per_token)[on].astype(np.float64)
        stats.update({f"{label}/count": float(values.size), f"{label}/sum": float(values.sum()),
                      f"{label}/abs_sum": float(np.abs(values).sum()), f"{label}/square_sum": float((values ** 2).sum()),
                      f"{label}/max": float(values.max(initial=-np.inf)), f"{label}/min": float(values.min(initial=np.inf))})
    scores = np.asarray(prepared.scores)[np.asarray(prepared.valid) > 0].astype(np.float64)
    stats.update({"scores/count": float(scores.size), "scores/sum": float(scores.sum()),
                  "scores/square_sum": float((scores ** 2).sum())})
    return stats


def merge_batch_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """One :func:`batch_stats` for the union of the parts' rows."""
    merged = {}
    for key in parts[0]:
        values = [part[key] for part in parts]
        merged[key] = max(values) if key.endswith("/max") else min(values) if key.endswith("/min") else sum(values)
    return merged


def summarize_update(
    step_metrics: list[dict[str, Any]], batch_stats: list[dict[str, float]], elapsed: float,
    positions_per_epoch: int, epochs: int,
) -> dict[str, float]:
    """One update's metrics from its minibatch steps' outputs: token-weighted means of the loss terms, the
    first minibatch's ratio and log-prob gap (scored at the sampling parameters), advantage/return/score
    statistics (from every process's :func:`batch_stats`), counts and throughput."""
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
    totals = merge_batch_stats(batch_stats)
    for label in ("advantages", "returns"):
        count = max(totals[f"{label}/count"], 1.0)
        mean = totals[f"{label}/sum"] / count
        metrics[f"{label}/abs_mean"] = totals[f"{label}/abs_sum"] / count
        metrics.update({f"{label}/mean": mean,
                        f"{label}/std": math.sqrt(max(totals[f"{label}/square_sum"] / count - mean * mean, 0.0)),
                        f"{label}/max": totals[f"{label}/max"], f"{label}/min": totals[f"{label}/min"]})
    trajectories = max(totals["scores/count"], 1.0)
    score_mean = totals["scores/sum"] / trajectories
    metrics["scores/mean"] = score_mean
    metrics["scores/std"] = math.sqrt(max(totals["scores/square_sum"] / trajectories - score_mean ** 2, 0.0))
    metrics["trajectories"] = totals["scores/count"]
    agent_tokens = totals["advantages/count"]
    metrics["agent_tokens"] = agent_tokens
    metrics["update_seconds"] = elapsed
    metrics["tokens_per_s"] = positions_per_epoch * epochs / elapsed
    metrics["agent_tokens_per_s"] = agent_tokens * epochs / elapsed
    return metrics
