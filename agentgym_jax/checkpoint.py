"""Orbax checkpoints of the whole run state, for exact resume.

The state is the learner's tree (policy parameters, optimizer states, critic, reference, update count) plus a
small JSON record (training step, seed, schedule position, config). Everything else a run needs — the task order
and the random keys of a step — is a pure function of (seed, step), so restoring this state resumes exactly.

Saving is asynchronous. The manager keeps the last ``keep_last`` checkpoints plus the best one by evaluation
score. A latest checkpoint that fails to restore (corrupt, partial) is skipped with a warning and the previous
one is used.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as preservation

from agentgym_jax.errors import CheckpointError

EVAL_METRIC = "eval_score"


class RunCheckpointer:
    """Saves and restores ``(learner tree, json record)`` pairs under ``directory``."""

    def __init__(self, directory: str | Path, keep_last: int = 3, asynchronous: bool = True):
        self.directory = Path(directory).absolute()
        policy = preservation.AnyPreservationPolicy([
            preservation.LatestN(n=keep_last),
            preservation.BestN(get_metric_fn=lambda m: m[EVAL_METRIC], n=1, keep_checkpoints_without_metrics=False),
        ])
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, enable_async_checkpointing=asynchronous, create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "record"))

    def save(self, step: int, state: Any, record: dict[str, Any], eval_score: float | None = None) -> None:
        """Starts saving ``state`` and ``record`` as checkpoint ``step`` (returns before the write finishes)."""
        metrics = None if eval_score is None else {EVAL_METRIC: float(eval_score)}
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)),
            metrics=metrics,
            force=True,
        )

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
        """Restores the newest checkpoint that reads back; None when there is none.

        ``abstract_state`` is a tree of the same structure (e.g. a freshly built learner's state) giving shapes,
        dtypes and shardings.
        """
        self.manager.wait_until_finished()
        errors = []
        for step in reversed(self.steps()):
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore()
                    ),
                )
            except Exception as error:  # orbax raises many types for a damaged checkpoint
                logging.warning("checkpoint %d in %s cannot be restored (%s); trying the previous one",
                                step, self.directory, error)
                errors.append(f"step {step}: {error}")
                continue
            return step, restored["state"], dict(restored["record"])
        if errors:
            raise CheckpointError(
                f"no checkpoint in {self.directory} could be restored: " + "; ".join(errors)
            )
        return None

    def best_step(self) -> int | None:
        """The checkpoint with the best evaluation score, if any was evaluated."""
        return self.manager.best_step()

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
