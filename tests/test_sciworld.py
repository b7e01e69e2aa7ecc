"""SciWorld on the real ScienceWorld JVM: splits, gold-path solving, rewards, heap cap, no stray JVMs."""

from __future__ import annotations

import collections
from typing import Iterator

import psutil
import pytest

from environments.base import InvalidTaskError, make_env
from environments.react import FORMAT_REMINDER
from environments.sciworld.catalog import load_catalog, locate
from environments.sciworld.env import SciWorld
from environments.workers import EnvPool


def _jvm_of(env: SciWorld) -> psutil.Process:
    return psutil.Process(env._env._gateway.java_process.pid)


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture(scope="module")
def env() -> Iterator[SciWorld]:
    environment = make_env("sciworld", generate_gold_path=True)
    yield environment
    environment.close()


def test_splits_are_the_packages_variation_splits_and_disjoint() -> None:
    env = SciWorld()
    train, test, dev = (env.tasks(s) for s in ("train", "test", "dev"))
    assert (len(train), len(test), len(dev)) == (2312, 1171, 1156)
    ids = [{t.task_id for t in split} for split in (train, test, dev)]
    assert not ids[0] & ids[1] and not ids[0] & ids[2] and not ids[1] & ids[2]
    assert collections.Counter(t.subtask for t in test) == {
        "Electricity": 385, "Measurement": 319, "Classification": 300, "Biology": 105, "Matter": 36, "Chemistry": 26
    }
    everything = SciWorld(exclude_tasks=())
    assert len(everything.tasks("train")) + len(everything.tasks("test")) + len(everything.tasks("dev")) == 7207
    task, variation, split = locate(test[0].task_id)
    assert (task.code, variation, split) == ("1-1", 21, "test")


def test_catalogue_agrees_with_the_package(env: SciWorld) -> None:
    env.reset(0)
    simulator = env._env
    for task in load_catalog()[::7]:  # 5 of the 30 tasks keeps this quick
        simulator.load(task.name, 0, "")
        assert tuple(sorted(simulator.get_variations_test())) == task.variations["test"]
        assert tuple(sorted(simulator.get_variations_train())) == task.variations["train"]


@pytest.mark.parametrize("code", ["1-1", "2-1", "4-1"])
def test_gold_actions_reach_full_score(env: SciWorld, code: str) -> None:
    task = next(t for t in load_catalog() if t.code == code)
    task_id = task.offset + task.variations["test"][0]
    observation, info = env.reset(task_id)
    assert observation.startswith("Task Description:") and "This room is called" in observation
    assert (info["task_code"], info["subtask"], info["score"]) == (code, task.topic, 0)
    for action in info["gold_actions"]:
        result = env.step(f"Thought: follow the plan.\n\nAction:\n{action}")
    assert (result.reward, result.done, result.info["score"]) == (1.0, True, 100)


def test_failed_task_ends_with_reward_zero_and_raw_score(env: SciWorld) -> None:
    env.reset(21)  # boil, test variation: focusing on the wrong thing fails the task
    result = env.step("Action:\nfocus on door to kitchen")
    assert (result.reward, result.done, result.info["score"]) == (0.0, True, -100)


def test_malformed_actions_and_valid_action_listing(env: SciWorld) -> None:
    env.reset(21)
    assert env.step("no marker here").observation == FORMAT_REMINDER
    for garbage in ["Action:", "Action:\n" + "x" * 10_000, "Action: \u2603\u00e9\x00\x1b[31m", "Action:\n\n\n"]:
        result = env.step(garbage)
        assert result.observation == "No known action matches that input." and not result.done
    listing = env.step("Thought: what can I do?\n\nAction:\ncheck valid actions").observation
    assert listing.startswith("Valid actions: ") and "look around" in listing and "wait1" in listing
    with pytest.raises(InvalidTaskError, match=r"valid ids are 0\.\.7206"):
        env.reset(7207)


def test_jvm_heap_is_capped_and_close_ends_the_jvm() -> None:
    env = SciWorld()
    env.reset(21)
    jvm = _jvm_of(env)
    assert jvm.environ().get("JAVA_TOOL_OPTIONS") == "-Xmx512m -XX:+UseSerialGC"
    assert jvm.memory_info().rss < 700e6
    env.close()
    env.close()
    assert _gone(jvm.pid)


def test_pool_shutdown_and_worker_kill_leave_no_jvm() -> None:
    with EnvPool("sciworld", {}, num_workers=2, step_timeout_s=60) as pool:
        starts = pool.reset([21, 22])
        assert all(s.error is None for s in starts)
        jvms = {}
        for pid in pool.worker_pids():
            children = psutil.Process(pid).children(recursive=True)
            jvms[pid] = [c.pid for c in children if "java" in c.name()]
        assert all(len(found) == 1 for found in jvms.values())
        victim = pool.worker_pids()[0]
        pool._replace(0, "killed by the test", {})  # what a hang or crash triggers
        assert _gone(victim) and all(_gone(j) for j in jvms[victim])
        outcome = pool.step({s.episode_id: "Action:\nlook around" for s in starts})
        assert outcome[starts[0].episode_id].error == "killed by the test"  # episode 0 went to worker 0
        assert outcome[starts[1].episode_id].error is None
        assert "This room is called" in outcome[starts[1].episode_id].observation
    assert all(_gone(j) for found in jvms.values() for j in found)
