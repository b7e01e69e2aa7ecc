"""Whether a step gives the optimizer anything to learn from: RL signal diagnostics and the no-signal warning.

Group-relative estimators (GRPO, RLOO) only move the policy on groups whose samples scored differently; a group
of all failures (or all successes) has zero advantage everywhere. These metrics make that visible every step:

* ``diag/valid_action_rate``: share of agent turns whose action the environment understood (``info["action_valid"]``;
  absent when the environment does not report it).
* ``diag/groups_with_signal``: share of groups (samples of one task) whose scores are not all equal.
* ``diag/response_tokens``: mean generated tokens per agent turn.
* ``diag/abs_advantage``, ``diag/first_abs_logp_gap``, ``diag/first_ratio``, ``diag/entropy`` come from the learner
  (see :func:`learner_diagnostics`).

:class:`SignalMonitor` logs a warning when nearly no group carries signal for several steps in a row, naming the
likely causes and the settings that address them.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Mapping, Sequence

log = logging.getLogger(__name__)

SIGNAL_EPSILON = 1e-6  # scores closer than this count as equal


def groups_of(trajectories: Sequence[Any]) -> dict[int, list[Any]]:
    """Trajectories by ``group_id``, in first-seen order."""
    groups: dict[int, list[Any]] = collections.defaultdict(list)
    for trajectory in trajectories:
        groups[trajectory.group_id].append(trajectory)
    return dict(groups)


def has_signal(group: Sequence[Any]) -> bool:
    """True when the group's scores differ (so group-relative advantages are not all zero)."""
    scores = [float(t.score) for t in group]
    return len(scores) > 1 and max(scores) - min(scores) > SIGNAL_EPSILON


def rollout_diagnostics(trajectories: Sequence[Any]) -> dict[str, float]:
    """Signal metrics of one rollout (see the module docstring)."""
    groups = groups_of(trajectories)
    turns = sum(t.turns for t in trajectories)
    metrics = {
        "diag/groups_with_signal": sum(has_signal(g) for g in groups.values()) / max(1, len(groups)),
        "diag/groups": float(len(groups)),
        "diag/response_tokens": sum(t.num_agent_tokens for t in trajectories) / max(1, turns),
        "rollout/episodes": float(len(trajectories)),
        "rollout/successes": float(sum(bool(t.success) for t in trajectories)),
    }
    judged = sum(t.judged_actions for t in trajectories)
    if judged:
        metrics["diag/valid_action_rate"] = sum(t.valid_actions for t in trajectories) / judged
    return metrics


def learner_diagnostics(update_metrics: Mapping[str, float]) -> dict[str, float]:
    """The learner's signal metrics under ``diag/`` names (copied from its update metrics when present)."""
    names = {
        "advantages/abs_mean": "diag/abs_advantage",
        "first_minibatch/abs_logp_gap": "diag/first_abs_logp_gap",
        "first_minibatch/ratio": "diag/first_ratio",
        "first_minibatch/ratio_max": "diag/first_ratio_max",
        "entropy": "diag/entropy",
    }
    return {target: float(update_metrics[source]) for source, target in names.items() if source in update_metrics}


class SignalMonitor:
    """Warns once per streak when ``diag/groups_with_signal`` stays below ``threshold`` for ``patience`` steps."""

    def __init__(self, threshold: float = 0.1, patience: int = 3):
        self.threshold = threshold
        self.patience = patience
        self._streak = 0

    def observe(self, metrics: Mapping[str, float]) -> str | None:
        """Feeds one step's metrics; returns (and logs) the warning text on the step a streak reaches patience."""
        signal = metrics.get("diag/groups_with_signal")
        if signal is None:
            return None
        self._streak = self._streak + 1 if signal < self.threshold else 0
        if self._streak != self.patience:
            return None
        message = self.explain(metrics)
        log.warning(message)
        return message

    def explain(self, metrics: Mapping[str, float]) -> str:
        valid = metrics.get("diag/valid_action_rate")
        success = metrics.get("rollout/success", 0.0)
        lines = [
            f"RL has (almost) no signal: fewer than {self.threshold:.0%} of groups had differing rewards for "
            f"{self.patience} steps in a row, so group-relative advantages are ~0 and the policy barely moves."
        ]
        if valid is not None and valid < 0.2:
            lines.append(
                f"Likely cause: the model's actions are rarely understood (valid_action_rate={valid:.2f}). Try "
                "rollout.response_prefix='Action:\\n' (opens each turn at the action line), rollout.stop_at_newline"
                "=True, a lenient matcher (env.kwargs.action_matching='closest' for BabyAI), a shorter instruction, "
                "or rollout.temperature 0.7."
            )
        if success <= 0.02:
            lines.append("Every episode failed: choose an easier task family (env.train_subtasks), raise the "
                         "horizon, or give the model a stronger prompt.")
        elif success >= 0.98:
            lines.append("Every episode succeeded: the tasks are too easy; choose harder env.train_subtasks.")
        lines.append("Also: data.dynamic_sampling=True keeps only groups with signal (over-sampling tasks), and a "
                     "larger data.samples_per_task makes a differing sample in a group more likely.")
        return "\n".join(lines)


def progress_fields(metrics: dict[str, float]) -> dict[str, str]:
    """The progress bar's view of a step: success, reward, and whether RL had a signal."""
    fields = {"success": f"{metrics['rollout/success']:.2f}", "score": f"{metrics['rollout/score']:.3f}"}
    if "diag/valid_action_rate" in metrics:
        fields["valid"] = f"{metrics['diag/valid_action_rate']:.2f}"
    fields["signal"] = f"{metrics['diag/groups_with_signal']:.2f}"
    fields["horizon"] = str(metrics["horizon"])
    return fields
