"""Evaluation metrics: Avg@k, Pass@k (overall and per subtask) and Wilson score intervals.

* Avg@k: the mean final score over all k samples of all tasks.
* Pass@k: the share of tasks with at least one success among their k samples. Success is the environment's own
  definition, reported in ``info["success"]`` (BabyAI: mission completed; TextCraft: goal crafted; SciWorld: task
  completed, score 100), falling back to ``score > 0`` for environments that do not report it.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Sequence


def wilson_interval(successes: int, total: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The 95% (by default) Wilson score interval of a binomial proportion."""
    if total <= 0:
        return (0.0, 1.0)
    p = successes / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact endpoints, no rounding residue
    high = 1.0 if successes == total else min(1.0, centre + half)
    return (low, high)


def summarize(trajectories: Sequence[Any], k: int) -> dict[str, Any]:
    """Avg@k / Pass@k overall and per subtask from finished trajectories (k per task)."""
    by_task: dict[int, list[Any]] = collections.defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(t)

    def block(task_ids: Sequence[int]) -> dict[str, Any]:
        samples = [t for task in task_ids for t in by_task[task]]
        passed = sum(any(t.success for t in by_task[task]) for task in task_ids)
        return {
            "tasks": len(task_ids),
            "samples": len(samples),
            f"avg@{k}": sum(t.score for t in samples) / max(1, len(samples)),
            f"pass@{k}": passed / max(1, len(task_ids)),
            "success_rate": sum(t.success for t in samples) / max(1, len(samples)),
            "pass_wilson95": list(wilson_interval(passed, len(task_ids))),
            "mean_turns": sum(t.turns for t in samples) / max(1, len(samples)),
            "env_errors": sum(t.end_reason == "env_error" for t in samples),
        }

    summary_tasks = {str(task): any(t.success for t in samples) for task, samples in by_task.items()}
    subtasks: dict[str, list[int]] = collections.defaultdict(list)
    for task, samples in by_task.items():
        subtasks[samples[0].subtask].append(task)
    return {"k": k, "overall": block(list(by_task)), "subtasks": {s: block(ids) for s, ids in sorted(subtasks.items())},
            "passed_by_task": summary_tasks}


def paired_outcomes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per-task comparison of two evaluations on the same tasks: counts of tasks passed by both, by only one,
    by neither, and the exact two-sided McNemar (sign test) p-value of the discordant pairs."""
    first, second = before["passed_by_task"], after["passed_by_task"]
    if set(first) != set(second):
        raise ValueError("paired_outcomes needs two evaluations of the same tasks")
    counts = collections.Counter((first[t], second[t]) for t in first)
    gained, lost = counts[(False, True)], counts[(True, False)]
    discordant = gained + lost
    tail = sum(math.comb(discordant, i) for i in range(min(gained, lost) + 1)) / 2 ** discordant if discordant else 1.0
    return {"tasks": len(first), "both": counts[(True, True)], "gained": gained, "lost": lost,
            "neither": counts[(False, False)], "mcnemar_p": min(1.0, 2 * tail)}


def markdown_table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table (one row per subtask, then overall)."""
    k = summary["k"]
    lines = [f"| subtask | tasks | Avg@{k} | Pass@{k} | 95% Wilson (Pass) | mean turns |", "|---|---|---|---|---|---|"]
    rows = list(summary["subtasks"].items()) + [("**overall**", summary["overall"])]
    for name, block in rows:
        low, high = block["pass_wilson95"]
        lines.append(
            f"| {name} | {block['tasks']} | {block[f'avg@{k}']:.3f} | {block[f'pass@{k}']:.3f} | "
            f"[{low:.3f}, {high:.3f}] | {block['mean_turns']:.2f} |"
        )
    settings = summary.get("settings")
    if settings:
        lines += ["", "Settings: " + ", ".join(f"{key}={value!r}" for key, value in settings.items())]
    return "\n".join(lines) + "\n"
