"""EnvPool: parallel episodes, env exceptions, crashed/hung/killed workers, clean shutdown."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Sequence

import psutil
import pytest

from environments.base import Environment, StepResult, Task, register
from environments.textcraft.env import TextCraft
from environments.textcraft.solver import solve
from environments.workers import EnvPool, EpisodeOutcome, PoolError

THIS_MODULE = "tests.test_env_workers"


@register("faulty-test-env")
class FaultyEnv(Environment):
    """A tiny env whose actions misbehave on purpose: crash, hang, raise, sleep."""

    name = "faulty-test-env"

    def instruction(self) -> str:
        return "say anything"

    def tasks(self, split: str) -> Sequence[Task]:
        return [Task(0, "train", "all"), Task(1, "test", "all")]

    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        self.task_id, self.turns = task_id, 0
        return f"task {task_id}", {"pid": os.getpid()}

    def step(self, action_text: str) -> StepResult:
        self.turns += 1
        if action_text == "crash":
            os._exit(3)
        if action_text == "hang":
            time.sleep(600)
        if action_text == "raise":
            raise ValueError("boom from the env")
        if action_text == "unpicklable":
            return StepResult("fine", 0.0, False, {"pid": os.getpid(), "handle": lambda: None})
        if action_text.startswith("sleep "):
            time.sleep(float(action_text.split()[1]))
        return StepResult(f"echo {action_text}", float(self.turns >= 3), self.turns >= 3, {"pid": os.getpid()})


def _pool(num_workers: int, timeout: float = 20.0) -> EnvPool:
    return EnvPool("faulty-test-env", {}, num_workers=num_workers, step_timeout_s=timeout, import_modules=[THIS_MODULE])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_textcraft_episodes_reach_the_goal_through_the_pool(num_workers: int) -> None:
    env = TextCraft()
    task_ids = [5, 5, 300]
    with EnvPool("textcraft", {}, num_workers=num_workers, step_timeout_s=30.0) as pool:
        assert pool.instruction == env.instruction()
        starts = pool.reset(task_ids)
        assert [s.observation for s in starts] == [env.reset(t)[0] for t in task_ids]
        plans = {s.episode_id: solve(env.book, env.goal_of(t)) for s, t in zip(starts, task_ids)}
        final: dict[int, EpisodeOutcome] = {}
        while plans:
            outcomes = pool.step({e: "Thought: next\n\nAction:\n" + plan.pop(0) for e, plan in plans.items()})
            for episode_id, outcome in outcomes.items():
                assert outcome.error is None
                final[episode_id] = outcome
                if outcome.done or not plans[episode_id]:
                    del plans[episode_id]
        assert [final[s.episode_id].reward for s in starts] == [1.0, 1.0, 1.0]
        assert all(final[s.episode_id].done for s in starts)
        pool.close_episodes([s.episode_id for s in starts])
        assert pool.open_episodes == []


def test_episodes_spread_over_workers_and_steps_run_in_parallel() -> None:
    with _pool(2) as pool:
        starts = pool.reset([0, 0, 1, 1])
        assert len({s.info["pid"] for s in starts}) == 2  # balanced over both workers
        t0 = time.monotonic()
        outs = pool.step({s.episode_id: "sleep 0.6" for s in starts})
        elapsed = time.monotonic() - t0
        assert all(o.error is None and o.observation == "echo sleep 0.6" for o in outs.values())
        # two episodes per worker run one after the other (1.2 s); both workers at once, not 2.4 s
        assert 1.1 < elapsed < 2.2


@pytest.mark.parametrize("num_workers", [0, 1])
def test_env_exception_fails_only_that_episode(num_workers: int) -> None:
    with _pool(num_workers) as pool:
        a, b = pool.reset([0, 1])
        outs = pool.step({a.episode_id: "raise", b.episode_id: "hello"})
        assert outs[a.episode_id].done and "ValueError: boom from the env" in outs[a.episode_id].error
        assert outs[b.episode_id].error is None and outs[b.episode_id].observation == "echo hello"
        again = pool.step({a.episode_id: "hello", b.episode_id: "hello"})
        assert "ValueError" in again[a.episode_id].error  # a failed episode stays failed
        assert again[b.episode_id].error is None
        assert pool.replacements == 0


def test_unpicklable_info_fails_that_episode_and_keeps_the_worker() -> None:
    with _pool(1) as pool:
        a, b = pool.reset([0, 1])  # both on the one worker
        outs = pool.step({a.episode_id: "unpicklable", b.episode_id: "hello"})
        assert outs[a.episode_id].done and "info keys ['handle']" in outs[a.episode_id].error
        assert outs[b.episode_id].error is None and outs[b.episode_id].observation == "echo hello"
        assert pool.step({b.episode_id: "again"})[b.episode_id].error is None
        assert pool.replacements == 0


def test_describing_survives_a_worker_killed_before_the_call() -> None:
    with _pool(1) as pool:
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        time.sleep(0.2)
        assert [t.task_id for t in pool.tasks("train")] == [0, 1] and pool.replacements == 1


def test_crashing_worker_is_replaced_and_its_episodes_fail() -> None:
    with _pool(2) as pool:
        starts = pool.reset([0, 0, 1, 1])
        pid_of = {s.episode_id: s.info["pid"] for s in starts}
        crashing = starts[0].episode_id
        same_worker = [e for e, p in pid_of.items() if p == pid_of[crashing] and e != crashing]
        others = [e for e, p in pid_of.items() if p != pid_of[crashing]]
        outs = pool.step({crashing: "crash", **{e: "hi" for e in others}})
        assert outs[crashing].done and "worker process died (exit code 3)" in outs[crashing].error
        assert all(outs[e].error is None for e in others)
        assert pool.replacements == 1 and pid_of[crashing] not in pool.worker_pids()
        lost = pool.step({e: "hi" for e in same_worker})  # was on the dead worker, not in that batch
        assert all("worker process died" in lost[e].error for e in same_worker)
        fresh = pool.reset([0])[0]  # the replacement worker serves new episodes
        assert fresh.error is None and pool.step({fresh.episode_id: "x"})[fresh.episode_id].error is None


def test_hung_worker_times_out_and_is_replaced() -> None:
    with _pool(2, timeout=1.5) as pool:
        hung, fine = pool.reset([0, 1])
        assert hung.error is None and fine.error is None, (hung.error, fine.error)
        assert hung.info["pid"] != fine.info["pid"]
        t0 = time.monotonic()
        outs = pool.step({hung.episode_id: "hang", fine.episode_id: "hi"})
        assert time.monotonic() - t0 < 5
        assert "timed out" in outs[hung.episode_id].error and outs[hung.episode_id].done
        assert outs[fine.episode_id].error is None
        assert not psutil.pid_exists(hung.info["pid"]) or psutil.Process(hung.info["pid"]).status() == "zombie"
        assert pool.replacements == 1


def test_killing_a_worker_mid_step() -> None:
    with _pool(2) as pool:
        starts = pool.reset([0, 1, 0, 1])
        victim_pid = starts[0].info["pid"]
        killer = threading.Timer(0.4, os.kill, args=(victim_pid, signal.SIGKILL))
        killer.start()
        outs = pool.step({s.episode_id: "sleep 1.0" for s in starts})
        killer.join()
        for s in starts:
            if s.info["pid"] == victim_pid:
                assert outs[s.episode_id].done and "worker process died" in outs[s.episode_id].error
            else:
                assert outs[s.episode_id].error is None and outs[s.episode_id].observation == "echo sleep 1.0"
        survivors = [s.episode_id for s in starts if s.info["pid"] != victim_pid]
        pool.step({e: "go" for e in survivors})
        finished = pool.step({e: "go" for e in survivors})  # third turn: the env says done
        assert all(finished[e].done and finished[e].reward == 1.0 for e in survivors)
        assert len(pool.worker_pids()) == 2 and victim_pid not in pool.worker_pids()


def test_shutdown_leaves_no_worker_processes() -> None:
    pool = _pool(2)
    pool.reset([0, 1])
    pids = pool.worker_pids()
    pool.close()
    pool.close()  # twice is fine
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    with pytest.raises(PoolError, match="closed"):
        pool.reset([0])


def test_bad_arguments_get_clear_errors() -> None:
    with pytest.raises(PoolError, match="unknown environment 'nope'"):
        EnvPool("nope", {}, num_workers=0)
    with pytest.raises(PoolError, match="num_workers"):
        EnvPool("textcraft", {}, num_workers=-1)
    with EnvPool("textcraft", {}, num_workers=0) as pool:
        with pytest.raises(PoolError, match=r"unknown or closed episode ids \[42\]"):
            pool.step({42: "Action:\ninventory"})
        bad = pool.reset([10**6])[0]
        assert bad.done and "InvalidTaskError" in bad.error and "0..543" in bad.error
