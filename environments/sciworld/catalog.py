"""The ScienceWorld task catalogue: its 30 tasks and their train/dev/test variation splits.

The splits come from the `scienceworld` package itself (``get_variations_train/dev/test``), which needs
a JVM and ~4 s to query, so they are kept in ``variations.json`` next to this file. Regenerate it with
``python -m environments.sciworld.catalog`` after upgrading the package; tests check it still agrees.

Task ids are global: the package's tasks in their own order ("1-1", "1-2", ...), each taking a block of
ids as long as its number of variations, so ``task_id = offset(task) + variation``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

CATALOG_PATH = Path(__file__).with_name("variations.json")
VARIATION_SPLITS = ("train", "dev", "test")


@dataclasses.dataclass(frozen=True)
class SciWorldTask:
    """One ScienceWorld task (e.g. "1-1" boil) and its variations."""

    code: str  # "1-1"
    name: str  # "boil", the name the package loads
    topic: str  # "Matter": our subtask category
    title: str  # "Changes of State (Boiling)"
    offset: int  # first global task id of this task
    variations: dict[str, tuple[int, ...]]  # split -> variation indices

    @property
    def num_variations(self) -> int:
        return sum(len(v) for v in self.variations.values())


class CatalogError(RuntimeError):
    """Raised when variations.json is missing or does not describe the installed package."""


@functools.lru_cache(maxsize=1)
def load_catalog(path: str = str(CATALOG_PATH)) -> tuple[SciWorldTask, ...]:
    """The tasks of variations.json with their global id offsets."""
    try:
        rows = json.loads(Path(path).read_text())
    except FileNotFoundError as error:
        raise CatalogError(f"{path} is missing; run `python -m environments.sciworld.catalog`") from error
    tasks, offset = [], 0
    for row in rows:
        variations = {split: tuple(row[split]) for split in VARIATION_SPLITS}
        task = SciWorldTask(row["code"], row["name"], row["topic"], row["title"], offset, variations)
        expected = list(range(task.num_variations))
        if sorted(v for vs in variations.values() for v in vs) != expected:
            raise CatalogError(f"{path}: task {task.code} does not split variations 0..{len(expected) - 1}")
        tasks.append(task)
        offset += task.num_variations
    return tuple(tasks)


def locate(task_id: int) -> tuple[SciWorldTask, int, str]:
    """Maps a global task id to (task, variation, variation split); raises IndexError if out of range."""
    for task in load_catalog():
        if task.offset <= task_id < task.offset + task.num_variations:
            variation = task_id - task.offset
            split = next(s for s, vs in task.variations.items() if variation in vs)
            return task, variation, split
    raise IndexError(task_id)


def query_package() -> list[dict[str, Any]]:
    """Reads the task list and variation splits from the installed package (starts one JVM)."""
    from scienceworld import ScienceWorldEnv
    from scienceworld.constants import TASKS

    from environments.sciworld.jvm import capped_jvm_options

    with capped_jvm_options():
        env = ScienceWorldEnv("", envStepLimit=100)
    try:
        rows = []
        for entry in TASKS:
            env.load(entry["task_name"], 0, "")
            rows.append(
                {
                    "code": entry["task_id"],
                    "name": entry["task_name"],
                    "topic": entry["topic"],
                    "title": entry["task"],
                    "train": sorted(env.get_variations_train()),
                    "dev": sorted(env.get_variations_dev()),
                    "test": sorted(env.get_variations_test()),
                }
            )
        return rows
    finally:
        env.close()


def main() -> None:
    rows = query_package()
    CATALOG_PATH.write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n")  # a task per line
    print(f"wrote {CATALOG_PATH}: {len(rows)} tasks, {sum(len(r['train']) + len(r['dev']) + len(r['test']) for r in rows)} variations")


if __name__ == "__main__":
    main()
