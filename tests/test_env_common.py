"""Checks every registered environment must pass: splits, subtasks, bad actions, determinism.

New environments are picked up from the registry automatically. ``agentgym_http`` is left out: it is a
client for a remote server, checked against our server in test_env_http.py. ``webarena`` is left out: its tasks
need live WebArena sites; ``webarena_local`` runs the same env code on our local shop here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from environments.base import SPLITS, Environment, make_env, registered_environments
from environments.workers import EnvPool

REPO = Path(__file__).resolve().parents[1]
ENV_NAMES = [  # our own environments; tests may register toy ones, which are not checked here
    name
    for name in registered_environments()
    if name not in ("agentgym_http", "webarena") and type(make_env(name)).__module__.startswith("environments.")
]

BAD_TURNS = [
    "",
    "   \n\n  ",
    "Thought: I am not sure what to do.",  # no Action: at all
    "Action:",
    "Action:\n",
    "Action:\n" + "go " * 5000,  # over-long
    "Action:\n\u2603\u00e9\u4e2d\u6587\x00\x1b[31m\ud83d\ude00",  # unicode garbage, control bytes
    "Action:\nAction:\nAction:",
    "Thought: " + "\u0000" * 100 + "\n\nAction:\n!!!???",
]


@pytest.fixture(scope="module", params=ENV_NAMES)
def env(request) -> Iterator[Environment]:
    environment = make_env(request.param)
    yield environment
    environment.close()


def test_expected_environments_are_registered() -> None:
    assert {"textcraft", "sciworld"} <= set(ENV_NAMES)


def test_splits_are_disjoint_non_empty_and_labelled(env: Environment) -> None:
    splits = {split: list(env.tasks(split)) for split in SPLITS}
    ids = {split: [t.task_id for t in tasks] for split, tasks in splits.items()}
    for split, tasks in splits.items():
        assert tasks, f"{env.name} has an empty {split} split"
        assert len(set(ids[split])) == len(ids[split]), f"{env.name} repeats task ids in {split}"
        assert all(t.split == split and t.subtask for t in tasks)
    assert not set(ids["train"]) & set(ids["test"]), f"{env.name} train and test overlap"
    assert list(env.tasks("test")) == splits["test"]  # same order every call


def test_bad_turns_get_a_message_never_a_crash(env: Environment) -> None:
    task_id = env.tasks("test")[0].task_id
    env.reset(task_id)
    for turn in BAD_TURNS:
        result = env.step(turn)
        assert isinstance(result.observation, str) and result.observation.strip(), repr(turn[:40])
        assert 0.0 <= result.reward <= 1.0


def test_bad_turns_through_a_worker_keep_the_worker_alive() -> None:
    for name in ENV_NAMES:
        with EnvPool(name, {}, num_workers=1, step_timeout_s=60) as pool:
            task_id = pool.tasks("test")[0].task_id
            (start,) = pool.reset([task_id])
            assert start.error is None, start.error
            pid = pool.worker_pids()
            for turn in BAD_TURNS:
                outcome = pool.step({start.episode_id: turn})[start.episode_id]
                assert outcome.error is None, (name, turn[:40], outcome.error)
            assert pool.worker_pids() == pid and pool.replacements == 0


def _first_observations(hash_seed: str) -> dict[str, list[str]]:
    script = (
        "import json\n"
        "from environments.base import make_env\n"
        f"names = {ENV_NAMES!r}\n"
        "out = {}\n"
        "for name in names:\n"
        "    env = make_env(name)\n"
        "    ids = [env.tasks('test')[0].task_id, env.tasks('test')[-1].task_id, env.tasks('train')[3].task_id]\n"
        "    out[name] = [env.reset(i)[0] for i in ids]\n"
        "    env.close()\n"
        "print('RESULT' + json.dumps(out))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    line = next(l for l in completed.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_first_observation_is_identical_across_processes_and_hash_seeds() -> None:
    first, second = _first_observations("1"), _first_observations("4242")
    assert set(first) == set(ENV_NAMES)
    for name in ENV_NAMES:
        assert first[name] == second[name], f"{name}: first observation depends on the process"
        assert len(set(first[name])) == 3, f"{name}: different tasks gave the same observation"


def test_task_files_round_trip_and_stay_disjoint(tmp_path: Path) -> None:
    from environments.tasks import TaskFileError, read_task_file, write_task_files

    write_task_files(tmp_path, ENV_NAMES)
    for name in ENV_NAMES:
        env = make_env(name)
        read = {split: read_task_file(tmp_path / f"{name}_{split}.jsonl", name, split) for split in SPLITS}
        assert read["test"] == list(env.tasks("test")) and read["train"] == list(env.tasks("train"))
        assert not {t.task_id for t in read["train"]} & {t.task_id for t in read["test"]}
        env.close()
    first = json.loads((tmp_path / "textcraft_test.jsonl").read_text().splitlines()[0])
    assert first == {"item_id": "textcraft_2", "task_id": 2, "split": "test", "subtask": "depth-1", "goal": "minecraft:beacon"}
    with pytest.raises(TaskFileError, match="not a textcraft train task"):
        read_task_file(tmp_path / "textcraft_test.jsonl", "textcraft", "train")
    with pytest.raises(TaskFileError, match="does not exist"):
        read_task_file(tmp_path / "nope.jsonl", "textcraft", "train")
