"""Task datasets: each environment's train/test task lists as plain JSON-lines files.

    python -m environments.tasks --out_dir=runs/tasks --envs=textcraft,sciworld,babyai

writes ``<out_dir>/<env>_<split>.jsonl``, one task a line:
``{"item_id": "textcraft_17", "task_id": 17, "split": "test", "subtask": "depth-1", "goal": "minecraft:..."}``.
``item_id`` is the original AgentGym-RL row format (``<task>_<int>``); the extra fields are whatever the
environment's ``task_details(task_id)`` reports (goal item, ScienceWorld task and variation, ...).

These files are exports for reading and diffing. The trainer and ``launch.eval`` read their task lists from the
TFDS task datasets (:mod:`environments.task_datasets`), which give each process of a multi-process run its own
share; both come from the environments' ``tasks(split)``, the source of truth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from environments.base import SPLITS, Environment, Task, check_split, make_env


class TaskFileError(ValueError):
    """A task file that is missing, malformed, or not of the expected environment and split."""


def task_rows(env: Environment, env_name: str, split: str) -> list[dict[str, Any]]:
    """The rows of one split, in the environment's order."""
    details = getattr(env, "task_details", None)
    rows = []
    for task in env.tasks(check_split(split)):
        row = {"item_id": f"{env_name}_{task.task_id}", "task_id": task.task_id, "split": task.split, "subtask": task.subtask}
        if details is not None:
            row.update(details(task.task_id))
        rows.append(row)
    return rows


def write_task_files(out_dir: str | Path, env_names: Sequence[str]) -> list[Path]:
    """Writes ``<env>_<split>.jsonl`` for every environment and split; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in env_names:
        env = make_env(name)
        try:
            for split in SPLITS:
                path = out / f"{name}_{split}.jsonl"
                path.write_text("".join(json.dumps(row) + "\n" for row in task_rows(env, name, split)))
                paths.append(path)
        finally:
            env.close()
    return paths


def read_task_file(path: str | Path, env_name: str, split: str) -> list[Task]:
    """Reads a file written by :func:`write_task_files`, checking every row belongs to ``env_name``/``split``."""
    file = Path(path)
    if not file.is_file():
        raise TaskFileError(f"{file} does not exist; write it with `python -m environments.tasks --out_dir=...`")
    tasks = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
            task = Task(int(row["task_id"]), row["split"], row["subtask"])
        except (ValueError, KeyError, TypeError) as error:
            raise TaskFileError(f"{file}:{number}: not a task row ({error}): {line[:120]!r}") from error
        if row.get("item_id") != f"{env_name}_{task.task_id}" or task.split != split:
            raise TaskFileError(f"{file}:{number}: row is not a {env_name} {split} task: {line[:120]!r}")
        tasks.append(task)
    return tasks


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    from environments.base import registered_environments

    names = [n for n in registered_environments() if n != "agentgym_http"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--envs", default=",".join(names), help=f"comma-separated, from {names}")
    args = parser.parse_args(argv)
    chosen = [n for n in args.envs.split(",") if n]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown environments {unknown}; choose from {names}")
    for path in write_task_files(args.out_dir, chosen):
        print(f"{path}: {sum(1 for _ in path.open())} tasks")


if __name__ == "__main__":
    main()
