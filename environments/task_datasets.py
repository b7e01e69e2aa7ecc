"""Task sets as TFDS datasets: one builder config per environment, ArrayRecord files, no TensorFlow.

    python -m environments.task_datasets --envs=babyai,textcraft   # built at set-up (`make setup`)

builds ``<cache>/tfds/agentgym_tasks/<env>/<version>/`` with ``train`` and ``test`` splits, one row per task in
the environment's own order: ``item_id`` (``<env>_<task_id>``), ``task_id``, ``split``, ``subtask`` and
``details`` (the env's ``task_details`` as JSON). Read them as random-access data sources, one process's share at a
time:

    source = task_source("babyai", "train", process_index=0, process_count=2)   # tfds.split_for_jax_process
    tasks = read_tasks("babyai", "test")                                       # list[Task], as env.tasks("test")

The environments' ``tasks(split)`` stay the source of truth (this module builds from them). Environment
arguments that change the task lists (e.g. BabyAI's ``num_test_seeds``) get their own builder config, named
``<env>-<hash of the arguments>`` and built on first use (``ensure_task_dataset``); the trainer and ``launch.eval``
read their tasks that way. The validation split is carved out of ``train`` by the trainer with its seed.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from environments.base import SPLITS, Task, check_split, make_env, registered_factory
from environments.tasks import task_rows

TASK_ENVS = ("babyai", "textcraft", "sciworld", "searchqa", "miniwob")  # webarena needs live sites
_ROW_KEYS = ("item_id", "task_id", "split", "subtask")


class _WithoutCustomConfigNotice(logging.Filter):
    """TFDS warns on every builder made from a config object; here that is the normal case, not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Using custom data configuration")


logging.getLogger("absl").addFilter(_WithoutCustomConfigNotice())


class TaskDatasetError(ValueError):
    """A task dataset that was not built or is asked for an unknown environment."""


def default_data_dir() -> Path:
    """``$AGENTGYM_JAX_TASK_DATA`` if set, else ``<cache>/tfds`` (see ``AGENTGYM_JAX_CACHE``)."""
    from agentgym_jax.default_model import cache_root

    override = os.environ.get("AGENTGYM_JAX_TASK_DATA")
    return Path(override) if override else cache_root() / "tfds"


@dataclasses.dataclass(eq=False)
class TaskSetConfig(tfds.core.BuilderConfig):
    """One environment with the constructor arguments its task lists come from."""

    env_name: str = ""
    env_kwargs_json: str = "{}"  # sorted-key JSON of the arguments (a hashable, printable form)
    import_modules: tuple[str, ...] = ()  # modules that register a user's environment


def code_fingerprint(env_name: str, import_modules: Sequence[str] = ()) -> str:
    """SHA-1 of the code an environment's task lists come from: the Python files of its package (a built-in
    ``environments.<name>``) or its module (a user's), and the pinned requirements when present."""
    for module in import_modules:
        importlib.import_module(module)
    module = sys.modules[registered_factory(env_name).__module__]
    source = Path(module.__file__ or "")
    package = module.__name__.split(".")
    files = sorted(source.parent.glob("*.py")) if package[0] == "environments" and len(package) > 2 else [source]
    requirements = Path(__file__).resolve().parents[1] / "requirements.txt"
    digest = hashlib.sha1()
    for path in files + ([requirements] if requirements.is_file() else []):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def task_set_config(env_name: str, env_kwargs: dict[str, Any] | None = None,
                    import_modules: Sequence[str] = ()) -> TaskSetConfig:
    """The builder config of ``env_name`` built with ``env_kwargs``: ``<env>-<10 hex digits>``, a hash of the
    arguments and of :func:`code_fingerprint`, so other arguments or changed environment code (or pins) give
    another dataset and a stale one is never read."""
    kwargs_json = json.dumps(dict(env_kwargs or {}), sort_keys=True, default=list)
    key = kwargs_json + code_fingerprint(env_name, import_modules)
    return TaskSetConfig(name=f"{env_name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}",
                         description=f"{env_name} tasks with {kwargs_json}", env_name=env_name,
                         env_kwargs_json=kwargs_json, import_modules=tuple(import_modules))


class AgentgymTasks(tfds.core.GeneratorBasedBuilder):
    """The train/test task lists of one agentgym-jax environment (the builder config names it)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "item_id, task_id, split, subtask and JSON task details, in the env's order."}
    BUILDER_CONFIGS: list[tfds.core.BuilderConfig] = []  # made per environment and arguments: task_set_config
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
        config = self.builder_config
        for module in config.import_modules:
            importlib.import_module(module)
        env = make_env(config.env_name, **json.loads(config.env_kwargs_json))
        try:
            rows = {split: task_rows(env, config.env_name, split) for split in SPLITS}
        finally:
            env.close()
        return {split: self._generate_examples(rows[split]) for split in SPLITS}

    def _generate_examples(self, rows: Sequence[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
        for index, row in enumerate(rows):
            details = {k: v for k, v in row.items() if k not in _ROW_KEYS}
            yield index, {**{k: row[k] for k in _ROW_KEYS}, "details": json.dumps(details, sort_keys=True)}


def task_builder(env_name: str, data_dir: str | Path | None = None, env_kwargs: dict[str, Any] | None = None,
                 import_modules: Sequence[str] = ()) -> AgentgymTasks:
    """The builder of ``env_name``'s task dataset (with ``env_kwargs``, its own config; see :func:`task_set_config`)."""
    if env_name == "webarena":
        raise TaskDatasetError("webarena's tasks need its live sites; it has no task dataset")
    config = task_set_config(env_name, env_kwargs, import_modules)
    return AgentgymTasks(config=config, data_dir=str(data_dir or default_data_dir()), file_format="array_record")


def ensure_task_dataset(env_name: str, env_kwargs: dict[str, Any] | None = None, import_modules: Sequence[str] = (),
                        data_dir: str | Path | None = None) -> AgentgymTasks:
    """The prepared builder of ``env_name`` with ``env_kwargs``, built first if needed (one process at a time: a
    lock file beside the dataset keeps concurrent runs from building the same one twice)."""
    builder = task_builder(env_name, data_dir, env_kwargs, import_modules)
    if builder.is_prepared():
        return builder
    root = Path(data_dir or default_data_dir())
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{builder.builder_config.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        builder = task_builder(env_name, data_dir, env_kwargs, import_modules)
        if not builder.is_prepared():
            tfds.disable_progress_bar()  # about a second of work; the run's own bars stay readable
            builder.download_and_prepare()
    return builder


def build_task_datasets(env_names: Sequence[str] = TASK_ENVS, data_dir: str | Path | None = None) -> list[Path]:
    """Builds (or reuses) every named environment's dataset; returns their directories."""
    built = []
    for name in env_names:
        builder = task_builder(name, data_dir)
        builder.download_and_prepare()
        built.append(Path(builder.data_dir))
    return built


def task_source(env_name: str, split: str, process_index: int = 0, process_count: int = 1,
                data_dir: str | Path | None = None, env_kwargs: dict[str, Any] | None = None) -> Any:
    """Random-access source of process ``process_index``'s share of ``split`` (TFDS's per-process split:
    contiguous, disjoint, covering; sizes differ by at most one)."""
    builder = task_builder(env_name, data_dir, env_kwargs)
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
                   data_dir: str | Path | None = None, env_kwargs: dict[str, Any] | None = None
                   ) -> list[dict[str, Any]]:
    source = task_source(env_name, split, process_index, process_count, data_dir, env_kwargs)
    return [decode_row(source[i]) for i in range(len(source))]


def read_tasks(env_name: str, split: str, process_index: int = 0, process_count: int = 1,
               data_dir: str | Path | None = None, env_kwargs: dict[str, Any] | None = None) -> list[Task]:
    """This process's share of ``split`` as :class:`Task` objects, in the environment's order."""
    return [Task(row["task_id"], row["split"], row["subtask"])
            for row in read_task_rows(env_name, split, process_index, process_count, data_dir, env_kwargs)]


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
