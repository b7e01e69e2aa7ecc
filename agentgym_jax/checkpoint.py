"""Orbax checkpoints of the whole run state, for exact resume.

The state is the learner's tree (policy parameters, optimizer states, critic, reference, update count) plus a
small JSON record (training step, seed, schedule position, config). Everything else a run needs — the task order
and the random keys of a step — is a pure function of (seed, step), so restoring this state resumes exactly.

Saving is asynchronous. The manager keeps the last ``keep_last`` checkpoints plus the best one by evaluation
score. A latest checkpoint that fails to restore (corrupt, partial) is skipped with a warning and the previous
one is used.

A save first checks that the disk has room for the state, and a failed write (disk full, read-only or vanished
directory) is raised as a ``CheckpointError`` naming the step, the directory and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

import jax
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
        self._pending: int | None = None  # the step of the last save started
        self.skipped: list[int] = []  # checkpoints the last restore passed over because they did not read back

    def save(self, step: int, state: Any, record: dict[str, Any], eval_score: float | None = None) -> None:
        """Starts saving ``state`` and ``record`` as checkpoint ``step`` (returns before the write finishes)."""
        self._check_room(step, state)
        metrics = None if eval_score is None else {EVAL_METRIC: float(eval_score)}
        with self._failures(f"writing checkpoint {step}"):
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)),
                metrics=metrics,
                force=True,
            )
        self._pending = step

    def _check_room(self, step: int, state: Any) -> None:
        needed = sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree_util.tree_leaves(state))
        free = shutil.disk_usage(self.directory if self.directory.exists() else self.directory.parent).free
        if free < 1.1 * needed + 64 * 2**20:
            raise CheckpointError(
                f"not enough disk space for checkpoint {step} in {self.directory}: it needs about "
                f"{needed / 1e9:.2f} GB and {free / 1e9:.2f} GB are free; free space, lower train.keep_checkpoints "
                "or point --workdir at a larger disk (the last checkpoint on disk is intact)")

    @contextlib.contextmanager
    def _failures(self, what: str) -> Iterator[None]:
        """Turns an I/O failure of ``what`` into a CheckpointError that names its cause first."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as error:  # orbax wraps the OSError of a failed write in its own types
            cause: BaseException | None = error
            while cause is not None and not isinstance(cause, OSError):
                cause = cause.__cause__ or cause.__context__
            if not isinstance(cause, OSError):
                raise
            reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                      errno.EACCES: "permission denied"}.get(cause.errno, cause.strerror or str(cause))
            raise CheckpointError(f"{what} in {self.directory} failed: {reason} ({cause}); free space or point "
                                  "--workdir at a writable disk, then --resume") from error

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
        """Restores the newest checkpoint that reads back; None when there is none.

        ``abstract_state`` is a tree of the same structure (e.g. a freshly built learner's state) giving shapes,
        dtypes and shardings.
        """
        self.wait()
        errors = []
        self.skipped = []
        for step in reversed(self.steps()):
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore()
                    ),
                )
            except Exception as error:  # orbax raises many types for a damaged checkpoint
                only_saved, only_built = _structure_mismatch(str(error))
                if only_saved or only_built:  # another model/config, not damage: older checkpoints are alike
                    raise CheckpointError(
                        f"checkpoint {step} in {self.directory} holds a different learner state than this config "
                        f"builds ({len(only_saved)} entries only in the checkpoint, e.g. {only_saved[:3]}; "
                        f"{len(only_built)} only in this config, e.g. {only_built[:3]}); use the run's own config "
                        "(run.json in its run directory records it), including model.lora_* and algo settings"
                    ) from None
                logging.warning("checkpoint %d in %s cannot be restored (%s); trying the previous one",
                                step, self.directory, error)
                errors.append(f"step {step}: {error}")
                self.skipped.append(step)
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
        with self._failures(f"writing checkpoint {self._pending}"):
            self.manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self.manager.close()


def _structure_mismatch(message: str) -> tuple[list[str], list[str]]:
    """(keys only on disk, keys only in the restore target) from orbax's structure-mismatch message, where the
    ``Source`` is the tree we asked for and the ``Target`` the checkpoint's."""
    only_saved, only_built, key = [], [], None
    for line in message.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith(":"):
            key = line.rstrip()[:-1]
        elif key and line.strip() == "- Target: MISSING":
            only_built.append(key)
        elif key and line.strip() == "- Source: MISSING":
            only_saved.append(key)
    return only_saved, only_built
