"""Learning curves of a training run: ``plot_run(directory)`` draws ``directory/training.png``.

Reads the per-step rows of ``metrics.jsonl`` and, if present, the held-out test evaluations ``eval_before.json`` and
``eval_after.json`` (summaries from :func:`agentgym_jax.evaluation.summarize`). Panels, sharing the training step:

1. success: per-step training success with a 95% Wilson band, a rolling success pooled over the last steps, the
   held-out test evaluation before and after training (and periodic evaluations, if logged);
2. reward; 3. signal diagnostics (valid actions, GRPO groups with reward variance); 4. optimizer diagnostics
   (|advantage|, entropy, learner-vs-sampler log-prob gap); 5. response length.

A metric missing from every row is skipped and its panel says "not logged".
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from agentgym_jax.evaluation import wilson_interval
from agentgym_jax.metrics_log import read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes

SUCCESS, EPISODES, SCORE = "rollout/success", "rollout/episodes", "rollout/score"
EVAL_SUCCESS, EVAL_SCORE = "eval/success", "eval/score"  # periodic test evaluations during training (optional)
SIGNAL = {"diag/valid_action_rate": "valid actions (turns the env could parse)",
          "diag/groups_with_signal": "GRPO groups with reward variance"}
OPTIMIZER = {"diag/abs_advantage": "mean |advantage| (agent tokens)", "diag/entropy": "entropy"}
LOGP_GAP = {"diag/first_abs_logp_gap": "|learner − sampler log-prob|, 1st minibatch"}
RESPONSE = {"diag/response_tokens": "generated tokens per agent turn"}
ROLLING_WINDOW = 4


@dataclass(frozen=True)
class HeldOut:
    """One held-out test evaluation: Pass@k with its 95% Wilson interval over ``tasks`` tasks."""

    value: float
    low: float
    high: float
    k: int
    tasks: int | None


def wilson_band(rates: Sequence[float], episodes: Sequence[float]) -> list[tuple[float, float]]:
    """The 95% Wilson interval of each step's success rate, given the number of episodes of that step."""
    return [wilson_interval(round(rate * n), round(n)) for rate, n in zip(rates, episodes)]


def rolling_success(rates: Sequence[float], episodes: Sequence[float] | None = None,
                    window: int = ROLLING_WINDOW) -> list[float]:
    """Success over the last ``window`` steps: pooled successes / pooled episodes (plain mean without counts)."""
    weights = [1.0] * len(rates) if episodes is None else [float(round(n)) for n in episodes]
    wins = [rate if episodes is None else float(round(rate * n)) for rate, n in zip(rates, weights)]
    out = []
    for i in range(len(rates)):
        start = max(0, i + 1 - window)
        total = sum(weights[start:i + 1])
        out.append(sum(wins[start:i + 1]) / total if total > 0 else math.nan)
    return out


def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` over the rows that logged a finite value of it."""
    points = [(int(r["step"]), float(r[key])) for r in rows
              if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def load_held_out(path: str | Path) -> HeldOut | None:
    """The overall Pass@k of an evaluation summary JSON, or None if the file is absent or unreadable."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
        overall, k = summary["overall"], int(summary.get("k", 1))
        low, high = overall["pass_wilson95"]
        value = overall.get(f"pass@{k}", overall["success_rate"])
        return HeldOut(float(value), float(low), float(high), k, overall.get("tasks"))
    except (ValueError, KeyError, TypeError) as error:
        warnings.warn(f"plots: cannot read the evaluation summary {path}: {error!r}")
        return None


def _say_missing(axis: Axes, missing: Sequence[str], plotted: bool) -> None:
    if not missing:
        return
    text = "not logged: " + ", ".join(missing)
    if plotted:
        axis.text(0.99, 0.03, text, transform=axis.transAxes, ha="right", va="bottom", fontsize=8, color="gray")
    else:
        axis.text(0.5, 0.5, text, transform=axis.transAxes, ha="center", va="center", fontsize=10, color="gray")


def _plot_keys(axis: Axes, rows: Sequence[Mapping[str, Any]], labels: Mapping[str, str],
               colors: Sequence[str]) -> list[str]:
    """Draws each metric that some row logged; returns the names of those no row logged."""
    missing = []
    for (key, label), color in zip(labels.items(), colors):
        steps, values = series(rows, key)
        if steps:
            axis.plot(steps, values, marker="o", markersize=3, color=color, label=f"{label} ({key})")
        else:
            missing.append(key)
    return missing


def _legend(*axes: Axes) -> None:
    handles = [h for a in axes for h in a.get_legend_handles_labels()[0]]
    labels = [lab for a in axes for lab in a.get_legend_handles_labels()[1]]
    if handles:
        axes[0].legend(handles, labels, loc="best", fontsize=7.5, framealpha=0.85)


def _success_panel(axis: Axes, rows: Sequence[Mapping[str, Any]], before: HeldOut | None, after: HeldOut | None,
                   last_step: int) -> None:
    steps, rates = series(rows, SUCCESS)
    if steps:
        by_step = {int(r["step"]): r.get(EPISODES) for r in rows}
        episodes = [by_step[s] for s in steps]
        counted = all(isinstance(n, (int, float)) and math.isfinite(n) and n > 0 for n in episodes)
        if counted:
            lows, highs = zip(*wilson_band(rates, episodes))
            axis.fill_between(steps, lows, highs, color="tab:blue", alpha=0.18, linewidth=0,
                              label=f"95% Wilson band ({EPISODES} per step)")
        axis.plot(steps, rates, marker="o", markersize=3, linewidth=1, color="tab:blue", label=f"per step ({SUCCESS})")
        rolling = rolling_success(rates, episodes if counted else None)
        pooled = "pooled successes / pooled episodes" if counted else "mean of rates"
        axis.plot(steps, rolling, linewidth=2.6, color="navy",
                  label=f"rolling, last {ROLLING_WINDOW} steps ({pooled})")
    eval_steps, eval_values = series(rows, EVAL_SUCCESS)
    if eval_steps:
        axis.plot(eval_steps, eval_values, marker="s", linestyle="--", color="tab:green",
                  label=f"periodic test eval ({EVAL_SUCCESS})")
    for name, held, step, color in (("before", before, 0, "tab:red"), ("after", after, last_step, "darkorange")):
        if held is not None:
            size = f", {held.tasks} tasks" if held.tasks else ""
            label = (f"held-out {name} {held.value:.2f} [{held.low:.2f}, {held.high:.2f}] "
                     f"(pass@{held.k}, 95% Wilson{size})")
            error = [[max(0.0, held.value - held.low)], [max(0.0, held.high - held.value)]]
            axis.errorbar([step], [held.value], yerr=error, fmt="D", markersize=7, capsize=5, elinewidth=1.8,
                          color=color, zorder=5, label=label)
    _say_missing(axis, [] if steps else [SUCCESS], plotted=bool(eval_steps) or before is not None or after is not None)
    axis.set_ylim(-0.03, 1.03)
    axis.set_ylabel("success rate")
    axis.set_title("Training success (held-out test evaluation as diamonds)", fontsize=10)
    _legend(axis)


def _diagnostic_panels(axes: Sequence[Axes], rows: Sequence[Mapping[str, Any]]) -> None:
    reward, signal, optimizer, response = axes
    missing = _plot_keys(reward, rows, {SCORE: "mean reward per episode"}, ["tab:purple"])
    optional = _plot_keys(reward, rows, {EVAL_SCORE: "periodic test eval"}, ["tab:green"])
    _say_missing(reward, missing, plotted=len(missing) + len(optional) < 2)
    reward.set(ylabel="reward", title="Reward")

    missing = _plot_keys(signal, rows, SIGNAL, ["tab:cyan", "tab:olive"])
    _say_missing(signal, missing, plotted=len(missing) < len(SIGNAL))
    signal.set(ylim=(-0.03, 1.03), ylabel="fraction", title="Signal diagnostics")

    gap_axis = optimizer.twinx()
    missing = _plot_keys(optimizer, rows, OPTIMIZER, ["tab:brown", "tab:gray"])
    missing += _plot_keys(gap_axis, rows, LOGP_GAP, ["tab:pink"])
    gap_axis.set_ylabel("log-prob gap (nats)", fontsize=9)
    _say_missing(optimizer, missing, plotted=len(missing) < len(OPTIMIZER) + len(LOGP_GAP))
    optimizer.set(ylabel="|advantage|, entropy", title="Optimizer diagnostics (log-prob gap on the right axis)")
    _legend(optimizer, gap_axis)

    missing = _plot_keys(response, rows, RESPONSE, ["tab:blue"])
    _say_missing(response, missing, plotted=not missing)
    response.set(ylabel="tokens", title="Response length")
    for axis in (reward, signal, response):
        _legend(axis)


def plot_run(directory: str | Path) -> Path:
    """Draws the learning curves of the run in ``directory`` into ``directory/training.png``; returns that path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    directory = Path(directory)
    rows = read_metrics(directory)
    before = load_held_out(directory / "eval_before.json")
    after = load_held_out(directory / "eval_after.json")
    last_step = max((int(r["step"]) for r in rows), default=1)

    figure, axes = plt.subplots(5, 1, figsize=(9.5, 14), sharex=True,
                                gridspec_kw={"height_ratios": [1.6, 1, 1, 1, 0.8]})
    _success_panel(axes[0], rows, before, after, last_step)
    _diagnostic_panels(axes[1:], rows)
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("training step")
    if not rows:
        axes[-1].set_xlim(-0.5, last_step + 0.5)
    status = f"{len(rows)} logged steps" if rows else "metrics.jsonl is empty or missing: no steps logged yet"
    figure.suptitle(f"agentgym-jax training run: {directory.resolve().name} ({status})", fontsize=11)
    figure.tight_layout()
    out = directory / "training.png"
    partial = directory / ".training.png.partial"
    figure.savefig(partial, dpi=110, format="png")
    plt.close(figure)
    os.replace(partial, out)  # a reader never sees a half-written picture
    return out
