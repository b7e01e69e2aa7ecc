"""TFDS / ArrayRecord data: recorded rollouts, per-environment task datasets and the ArrayRecord corpus."""

import dataclasses

import numpy as np
import pytest

from agentgym_jax.rollout import Trajectory
from agentgym_jax.rollout_records import RolloutRecorder, RolloutRecordError, read_rollouts
from tests.test_trainer import tiny_config
from tests.tiny_models import save_tiny_chat_model

# -- recorded rollouts ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def _as_trajectory(row: dict) -> Trajectory:
    names = {f.name for f in dataclasses.fields(Trajectory)}
    values = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items() if k in names}
    return Trajectory(**values)


def test_recorded_rollouts_read_back_equal_to_what_was_trained_on(tiny_dir, tmp_path, monkeypatch):
    import agentgym_jax.host_shards as host_shards
    from agentgym_jax.trainer import LENGTH_BUCKETS, Trainer

    packed = []  # (trajectories, batch) of every update
    real_pack = host_shards.pack_trajectories

    def spy(trajectories, *args, **kwargs):
        batch = real_pack(trajectories, *args, **kwargs)
        packed.append((list(trajectories), batch, args, kwargs))
        return batch

    monkeypatch.setattr(host_shards, "pack_trajectories", spy)  # the trainer packs through host_shards
    trainer = Trainer(tiny_config(tiny_dir, tmp_path, steps=2, record_rollouts=True))
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert len(packed) == 2
    for step, (trained, batch, args, kwargs) in enumerate(packed, start=1):
        rows = read_rollouts(tmp_path / "rollouts", kind="train", steps=[step])
        assert len(rows) == len(trained) == 16 and all(r["trained"] and r["step"] == step for r in rows)
        for row, original in zip(rows, trained):
            back = _as_trajectory(row)
            assert back.tokens == original.tokens and back.loss_mask == original.loss_mask
            assert back.messages == original.messages and back.state_keys == original.state_keys
            assert (back.score, back.success, back.turns, back.end_reason, back.task_id, back.subtask) == (
                original.score, original.success, original.turns, original.end_reason, original.task_id,
                original.subtask)
            np.testing.assert_array_equal(np.float32(back.logprobs), np.float32(original.logprobs))
        again = real_pack([_as_trajectory(r) for r in rows], LENGTH_BUCKETS, *args[1:], **kwargs)
        for field in ("tokens", "loss_mask", "old_logp", "scores", "group_ids", "valid", "turn_ids"):
            np.testing.assert_array_equal(np.asarray(getattr(again, field)), np.asarray(getattr(batch, field)), field)


def test_rewind_drops_records_after_the_restored_step_and_rewrites_replace(tmp_path):
    import tensorflow_datasets as tfds

    episodes = [Trajectory(task_id=i, group_id=i, subtask="s", tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -0.5],
                           messages=[{"role": "user", "content": f"ü{i}"}], score=0.25 * i, turns=1,
                           end_reason="done") for i in range(3)]
    recorder = RolloutRecorder(tmp_path)
    for step in (1, 2, 3):
        recorder.write("train", step, episodes[:step])
    recorder.write("eval_after", 3, episodes)
    removed = recorder.rewind(1)
    assert sorted(p.name for p in removed) == sorted(
        [recorder.path("train", 2).name, recorder.path("train", 3).name, recorder.path("eval_after", 3).name])
    recorder.write("train", 2, episodes[2:])  # step 2 played again after the resume
    rows = read_rollouts(tmp_path)
    assert [(r["step"], r["task_id"]) for r in rows] == [(1, 0), (2, 2)]
    assert rows[0]["messages"] == [{"role": "user", "content": "ü0"}] and rows[0]["error"] is None
    source = tfds.builder_from_directory(tmp_path).as_data_source()  # the same files through TFDS
    assert sorted(source) == ["train_000001", "train_000002"] and source["train_000002"][0]["task_id"] == 2


def test_bad_rollout_kind_and_missing_directory_are_named(tmp_path):
    with pytest.raises(RolloutRecordError, match="lower-case words"):
        RolloutRecorder(tmp_path).path("Train-1", 1)
    with pytest.raises(RolloutRecordError, match="record_rollouts"):
        read_rollouts(tmp_path / "missing")


# -- task datasets --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def task_data_dir(tmp_path_factory):
    from environments.task_datasets import TASK_ENVS, build_task_datasets

    data_dir = tmp_path_factory.mktemp("tfds")
    build_task_datasets(TASK_ENVS, data_dir)
    return data_dir


@pytest.mark.parametrize("env_name", ["babyai", "textcraft", "sciworld", "searchqa", "miniwob"])
def test_task_dataset_reads_back_as_todays_task_lists(task_data_dir, env_name):
    from environments.base import make_env
    from environments.task_datasets import read_task_rows, read_tasks
    from environments.tasks import task_rows

    env = make_env(env_name)
    try:
        for split in ("train", "test"):
            assert read_task_rows(env_name, split, data_dir=task_data_dir) == task_rows(env, env_name, split)
            assert read_tasks(env_name, split, data_dir=task_data_dir) == env.tasks(split)
    finally:
        env.close()


@pytest.mark.parametrize("env_name", ["babyai", "textcraft"])
def test_two_processes_get_disjoint_covering_shares(task_data_dir, env_name):
    from environments.task_datasets import read_tasks

    for split in ("train", "test"):
        whole = read_tasks(env_name, split, data_dir=task_data_dir)
        first, second = (read_tasks(env_name, split, i, 2, data_dir=task_data_dir) for i in (0, 1))
        assert first and second and abs(len(first) - len(second)) <= 1
        assert not {t.task_id for t in first} & {t.task_id for t in second}
        assert first + second == whole


def test_unbuilt_or_unknown_task_dataset_names_the_fix(tmp_path, task_data_dir):
    from environments.task_datasets import TaskDatasetError, task_source

    with pytest.raises(TaskDatasetError, match="make setup"):
        task_source("babyai", "train", data_dir=tmp_path)
    with pytest.raises(TaskDatasetError, match="webarena's tasks need its live sites"):
        task_source("webarena", "train", data_dir=task_data_dir)
    with pytest.raises(TaskDatasetError, match="process_index=2"):
        task_source("babyai", "train", process_index=2, process_count=2, data_dir=task_data_dir)


def test_env_arguments_get_their_own_task_dataset(tmp_path):
    from environments.base import make_env
    from environments.task_datasets import ensure_task_dataset, read_tasks, task_builder

    kwargs = dict(num_test_seeds=2, num_train_seeds=3)
    built = ensure_task_dataset("babyai", kwargs, data_dir=tmp_path)
    assert built.builder_config.name.startswith("babyai-") and built.builder_config.name != "babyai"
    assert not task_builder("babyai", tmp_path).is_prepared()  # the default arguments are another dataset
    env = make_env("babyai", **kwargs)
    try:
        for split in ("train", "test"):
            assert read_tasks("babyai", split, data_dir=tmp_path, env_kwargs=kwargs) == env.tasks(split)
    finally:
        env.close()
    assert len(read_tasks("babyai", "test", data_dir=tmp_path, env_kwargs=kwargs)) == 2 * 40
    again = ensure_task_dataset("babyai", kwargs, data_dir=tmp_path)  # reused, not rebuilt
    assert again.data_dir == built.data_dir


def test_changed_environment_code_gives_another_task_dataset(tmp_path, monkeypatch):
    import importlib
    import sys

    from environments.task_datasets import task_set_config

    module = tmp_path / "my_tasks_env.py"
    source = (
        "from environments.base import Environment, Task, register\n"
        "@register('my_tasks_env')\n"
        "class MyEnv(Environment):\n"
        "    name = 'my_tasks_env'\n"
        "    def tasks(self, split): return [Task(i, split, 'a') for i in range({count})]\n"
    )
    module.write_text(source.format(count=3))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("my_tasks_env")
    first = task_set_config("my_tasks_env", {}, ("my_tasks_env",)).name
    assert first == task_set_config("my_tasks_env", {}, ("my_tasks_env",)).name  # stable
    assert first != task_set_config("my_tasks_env", {"x": 1}, ("my_tasks_env",)).name  # other arguments
    module.write_text(source.format(count=4))  # the task list changed: the old dataset must not be read
    assert first != task_set_config("my_tasks_env", {}, ("my_tasks_env",)).name
    sys.modules.pop("my_tasks_env", None)


def test_the_trainer_reads_its_tasks_from_the_task_dataset(tiny_dir, tmp_path, monkeypatch):
    import environments.task_datasets as task_datasets
    from agentgym_jax.trainer import Trainer

    monkeypatch.setenv("AGENTGYM_JAX_TASK_DATA", str(tmp_path / "tasks"))
    reads = []
    real_read = task_datasets.read_tasks
    monkeypatch.setattr(task_datasets, "read_tasks", lambda *a, **k: reads.append((a, k)) or real_read(*a, **k))
    config = tiny_config(tiny_dir, tmp_path / "run", steps=1)
    trainer = Trainer(config)
    try:
        assert [a[:2] for a, _ in reads] == [(config.env.name, "train"), (config.env.name, "test")]
        env_train = {t.task_id for t in trainer.pool.tasks("train")}  # the env itself, in its worker
        assert {t.task_id for t in trainer.train_tasks + trainer.validation_tasks} == env_train
        assert {t.task_id for t in trainer.test_tasks} <= {t.task_id for t in trainer.pool.tasks("test")}
        assert (tmp_path / "tasks" / "agentgym_tasks").is_dir()
    finally:
        trainer.close()


# -- the ArrayRecord corpus -----------------------------------------------------------------------------------


def test_arrayrecord_corpus_reads_every_passage_as_the_jsonl_corpus(tmp_path):
    from environments.searchqa.arrayrecord_corpus import ArrayRecordCorpus, convert_corpus
    from environments.searchqa.corpus import JsonlCorpus, Passage, write_corpus

    passages = [Passage(str(i), f"Title {i} é", f"text {i}\nwith a newline" * (i % 3)) for i in range(50)]
    write_corpus(passages, tmp_path / "corpus.jsonl")
    converted = convert_corpus(tmp_path / "corpus.jsonl", tmp_path / "corpus.array_record")
    jsonl, records = JsonlCorpus(tmp_path / "corpus.jsonl", tmp_path / "offsets.npy"), ArrayRecordCorpus(converted)
    try:
        assert len(records) == len(jsonl) == 50
        assert [records[i] for i in range(50)] == [jsonl[i] for i in range(50)] == passages
        assert records.get_many([49, 0, 7]) == [passages[49], passages[0], passages[7]]
        with pytest.raises(IndexError, match="out of range"):
            records[50]
    finally:
        jsonl.close()
        records.close()


def test_missing_arrayrecord_corpus_names_the_converter(tmp_path):
    from environments.searchqa.arrayrecord_corpus import ArrayRecordCorpus
    from environments.searchqa.corpus import CorpusError

    with pytest.raises(CorpusError, match="arrayrecord_corpus --corpus=FILE"):
        ArrayRecordCorpus(tmp_path / "none.array_record")


def test_arrayrecord_corpus_never_overwrites_a_file_it_did_not_write(tmp_path):
    from environments.searchqa.arrayrecord_corpus import write_arrayrecord_corpus
    from environments.searchqa.corpus import CorpusError, Passage

    foreign = tmp_path / "mine.array_record"
    foreign.write_text("user data")
    with pytest.raises(CorpusError, match="mine.array_record exists and was not written by write_arrayrecord_corpus"):
        write_arrayrecord_corpus([Passage("a", "A", "alpha")], foreign)
    assert foreign.read_text() == "user data"
    ours = tmp_path / "ours.array_record"
    assert write_arrayrecord_corpus([Passage("a", "A", "alpha")], ours) == 1
    assert write_arrayrecord_corpus([Passage("a", "A", "alpha"), Passage("b", "B", "beta")], ours) == 2  # ours: replaced
