"""Task sets as TFDS datasets: one builder config per environment, ArrayRecord files, no TensorFlow.

    python -m environments.task_datasets --envs=babyai,textcraft   # built at set-up (`make setup`)

builds ``<cache>/tfds/agentgym_tasks/<env>/<version>/`` with ``train`` and ``test`` splits, one row per task in
the environment's own order: ``item_id`` (``<env>_<task_id>``), ``task_id``, ``split``, ``subtask`` and
``details`` (the env's ``task_details`` as JSON). Read them as random-access data sources, one process's share at a
time:

    source = task_source("babyai", "train", process_index=0, process_count=2)   # tfds.split_for_jax_process
    tasks = read_tasks("babyai", "test")                                       # list[Task], as env.tasks("test")

The environments' ``tasks(split)`` stay the source of truth (this module builds from them with the default
environment arguments); the validation split is carved out of ``train`` by the trainer with its seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from environments.base import SPLITS, Task, check_split, make_env
from environments.tasks import task_rows

TASK_ENVS = ("babyai", "textcraft", "sciworld", "searchqa", "miniwob")  # webarena needs live sites
_ROW_KEYS = ("item_id", "task_id", "split", "subtask")


class TaskDatasetError(ValueError):
    """A task dataset that was not built or is asked for an unknown environment."""


def default_data_dir() -> Path:
    """``<cache>/tfds`` (see ``AGENTGYM_JAX_CACHE``)."""
    from agentgym_jax.default_model import cache_root

    return cache_root() / "tfds"


class AgentgymTasks(tfds.core.GeneratorBasedBuilder):
    """The train/test task lists of one agentgym-jax environment (the builder config names it)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "item_id, task_id, split, subtask and JSON task details, in the env's order."}
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=name, description=f"{name} tasks") for name in TASK_ENVS]
    # TFDS's own lookup of this file imports `importlib_resources`, which nothing else needs: name the file directly.
    code_path = epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        text = tfds.features.Text()
        return tfds.core.DatasetInfo(
            builder=self, description=__doc__.splitlines()[0], disable_shuffling=True,  # keep the env's order
            features=tfds.features.FeaturesDict({"item_id": text, "task_id": np.int64, "split": text,
                                                 "subtask": text, "details": text}),
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict[str, Any]]]]:
        env = make_env(self.builder_config.name)
        try:
            rows = {split: task_rows(env, self.builder_config.name, split) for split in SPLITS}
        finally:
            env.close()
        return {split: self._generate_examples(rows[split]) for split in SPLITS}

    def _generate_examples(self, rows: Sequence[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
        for index, row in enumerate(rows):
            details = {k: v for k, v in row.items() if k not in _ROW_KEYS}
            yield index, {**{k: row[k] for k in _ROW_KEYS}, "details": json.dumps(details, sort_keys=True)}


def task_builder(env_name: str, data_dir: str | Path | None = None) -> AgentgymTasks:
    if env_name not in TASK_ENVS:
        raise TaskDatasetError(f"no task dataset for {env_name!r}; choose from {list(TASK_ENVS)}")
    return AgentgymTasks(config=env_name, data_dir=str(data_dir or default_data_dir()), file_format="array_record")


def build_task_datasets(env_names: Sequence[str] = TASK_ENVS, data_dir: str | Path | None = None) -> list[Path]:
    """Builds (or reuses) every named environment's dataset; returns their directories."""
    built = []
    for name in env_names:
        builder = task_builder(name, data_dir)
        builder.download_and_prepare()
        built.append(Path(builder.data_dir))
    return built


def task_source(env_name: str, split: str, process_index: int = 0, process_count: int = 1,
                data_dir: str | Path | None = None) -> Any:
    """Random-access source of process ``process_index``'s share of ``split`` (TFDS's per-process split:
    contiguous, disjoint, covering; sizes differ by at most one)."""
    builder = task_builder(env_name, data_dir)
    if not builder.is_prepared():
        raise TaskDatasetError(f"the {env_name} task dataset is not built in {builder.data_dir}; run "
                               f"`python -m environments.task_datasets --envs={env_name}` (or `make setup`)")
    if not 0 <= process_index < process_count:
        raise TaskDatasetError(f"process_index={process_index} must be in 0..{process_count - 1}")
    part = tfds.split_for_jax_process(check_split(split), process_index=process_index, process_count=process_count)
    return builder.as_data_source(split=part)


def decode_row(example: dict[str, Any]) -> dict[str, Any]:
    """A data-source example as the row :func:`environments.tasks.task_rows` returns."""
    row = {k: (v.decode("utf-8") if isinstance(v, bytes) else v) for k, v in example.items()}
    details = json.loads(row.pop("details"))
    return {**{k: (int(row[k]) if k == "task_id" else row[k]) for k in _ROW_KEYS}, **details}


def read_task_rows(env_name: str, split: str, process_index: int = 0, process_count: int = 1,
                   data_dir: str | Path | None = None) -> list[dict[str, Any]]:
    source = task_source(env_name, split, process_index, process_count, data_dir)
    return [decode_row(source[i]) for i in range(len(source))]


def read_tasks(env_name: str, split: str, process_index: int = 0, process_count: int = 1,
               data_dir: str | Path | None = None) -> list[Task]:
    """This process's share of ``split`` as :class:`Task` objects, in the environment's order."""
    return [Task(row["task_id"], row["split"], row["subtask"])
            for row in read_task_rows(env_name, split, process_index, process_count, data_dir)]


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", default=",".join(TASK_ENVS), help=f"comma-separated, from {list(TASK_ENVS)}")
    parser.add_argument("--data_dir", default=None, help="default: <cache>/tfds")
    args = parser.parse_args(argv)
    chosen = [n for n in args.envs.split(",") if n]
    unknown = sorted(set(chosen) - set(TASK_ENVS))
    if unknown:
        parser.error(f"unknown environments {unknown}; choose from {list(TASK_ENVS)}")
    for name, path in zip(chosen, build_task_datasets(chosen, args.data_dir)):
        counts = {s: len(task_source(name, s, data_dir=args.data_dir)) for s in SPLITS}
        print(f"{path}: {counts}")


if __name__ == "__main__":
    main()
