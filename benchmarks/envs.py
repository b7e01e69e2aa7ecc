"""Environment throughput: env steps/s in-process, through EnvPool with 1/2/4 workers, over HTTP (one client,
one server), and through a pool of HTTP clients spread over a fleet of 1 and 3 local servers.

    python -m benchmarks.envs                       # all registered envs, writes benchmarks/results/envs.json
    python -m benchmarks.envs --envs=textcraft --steps=300 --repeats=3

Each measurement plays scripted turns (TextCraft: the solver's plan, SciWorld: the gold actions,
BabyAI: turn/move primitives), padded with a cheap action once the plan is used up (TextCraft:
``inventory``, SciWorld: ``look around``); TextCraft and SciWorld episodes go on after the goal, a
finished BabyAI episode is reset between timed calls. Only time spent in step calls counts; numbers
are medians over ``--repeats``. The pool steps 2 episodes per worker in each batch (SciWorld: 1, since
each episode holds a JVM); on a machine with fewer cores than workers, extra workers add no throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import requests

from benchmarks import web
from benchmarks.common import free_port
from environments.agentgym_http import AgentGymHTTPEnv
from environments.base import Environment, make_env, registered_environments
from environments.workers import EnvPool

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "envs.json"
EPISODES_PER_WORKER = {"sciworld": 1}  # default 2; every SciWorld episode holds a JVM of its own
ENV_KWARGS: dict[str, dict[str, Any]] = {"sciworld": {"generate_gold_path": True}}
PADDING = {"textcraft": "inventory", "sciworld": "look around", "babyai": "turn left",
           "searchqa": "<search>population of the capital</search>"}
BABYAI_CYCLE = ["turn left", "move forward", "turn right", "move forward"]
RESET_ON_DONE = {"babyai"}
NEEDS_DEPLOYMENT = {"webarena"}  # real WebArena sites by URL; not measurable offline
FLEET_WORKERS, FLEET_EPISODES_PER_WORKER = 2, 3  # 6 episodes per batch over 1 or 3 servers  # the others accept steps after the goal, so an episode just goes on


def _turns(env_name: str, info: dict[str, Any], goal_book: Environment | None, length: int) -> list[str]:
    """Scripted agent turns for one episode, ``length`` long."""
    if env_name in web.WEB_ENVS:
        return web.turns(env_name, info, length)  # navigation and scrolling, see benchmarks/web.py
    if env_name == "textcraft":
        from environments.textcraft.solver import solve

        plan = solve(goal_book.book, info["goal"])
    elif env_name == "sciworld":
        plan = list(info["gold_actions"])
    elif env_name == "searchqa":
        question = goal_book.questions[info["task_id"]]
        plan = [f"<search>{query}</search>" for query in question.gold_queries]
    else:
        plan = BABYAI_CYCLE * (length // len(BABYAI_CYCLE) + 1)
    plan = (plan + [PADDING.get(env_name, "look")] * length)[:length]
    return [f"Thought: next step.\n\nAction:\n{action}" for action in plan]


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def _sequential(env: Environment, env_name: str, task_ids: list[int], steps: int, helper: Environment | None) -> float:
    """Steps/s of one environment object stepped in a loop (resets not timed)."""
    elapsed, done_steps, task = 0.0, 0, 0
    while done_steps < steps:
        _, info = env.reset(task_ids[task % len(task_ids)])
        task += 1
        for turn in _turns(env_name, info, helper, steps - done_steps):
            start = time.perf_counter()
            result = env.step(turn)
            elapsed += time.perf_counter() - start
            done_steps += 1
            if result.done and env_name in RESET_ON_DONE:
                break
    return done_steps / elapsed


def _reset_ms(env: Environment, task_ids: list[int]) -> float:
    times = []
    for task_id in task_ids:
        start = time.perf_counter()
        env.reset(task_id)
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 2)


def _pooled(
    pool: EnvPool, env_name: str, task_ids: list[int], episodes: int, batches: int, helper: Environment | None
) -> float:
    """Steps/s of ``episodes`` episodes stepped together for ``batches`` rounds."""
    chosen = [task_ids[i % len(task_ids)] for i in range(episodes)]
    starts = pool.reset(chosen)
    plans = {s.episode_id: _turns(env_name, s.info, helper, batches) for s in starts}
    task_of = {s.episode_id: t for s, t in zip(starts, chosen)}
    elapsed, stepped = 0.0, 0
    for round_index in range(batches):
        batch = {e: plan[round_index] for e, plan in plans.items()}
        start = time.perf_counter()
        outcomes = pool.step(batch)
        elapsed += time.perf_counter() - start
        stepped += len(batch)
        finished = [e for e, o in outcomes.items() if o.done and env_name in RESET_ON_DONE]
        errors = [o.error for o in outcomes.values() if o.error]
        if errors:
            raise RuntimeError(f"{env_name} pool step failed: {errors[0]}")
        if finished:
            pool.close_episodes(finished)
            for old, new in zip(finished, pool.reset([task_of[e] for e in finished])):
                plans[new.episode_id] = _turns(env_name, new.info, helper, batches)
                task_of[new.episode_id] = task_of.pop(old)
                del plans[old]
    pool.close_episodes(list(plans))
    return stepped / elapsed


def _with_servers(env_name: str, count: int, run: Callable[[list[str]], Any]) -> Any:
    """Starts ``count`` of our env servers on loopback, runs ``run(urls)``, stops them."""
    kwargs = json.dumps(ENV_KWARGS.get(env_name, {}))
    ports = [free_port() for _ in range(count)]
    processes = [subprocess.Popen(
        [sys.executable, "-m", "launch.serve_env", f"--env={env_name}", f"--port={port}", f"--env_kwargs={kwargs}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    ) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in urls:
            for _ in range(600):
                try:
                    if requests.get(url + "/", timeout=1).status_code == 200:
                        break
                except requests.ConnectionError:
                    time.sleep(0.1)
        return run(urls)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)


def bench_env(env_name: str, steps: int, repeats: int, workers: list[int]) -> dict[str, Any]:
    kwargs = ENV_KWARGS.get(env_name, {})
    env = make_env(env_name, **kwargs)
    task_ids = [t.task_id for t in env.tasks("test")][:: max(1, len(env.tasks("test")) // 8)][:8]
    helper = env if env_name in ("textcraft", "searchqa") else None
    env.reset(task_ids[0])  # start any JVM before timing
    rate = _median([_sequential(env, env_name, task_ids, steps, helper) for _ in range(repeats)])
    env.close()
    plain = make_env(env_name)  # resets timed without extras such as SciWorld's gold-path generation
    plain.reset(task_ids[0])
    result: dict[str, Any] = {
        "task_ids": task_ids,
        "in_process": {"steps_per_s": rate, "reset_ms_median": _reset_ms(plain, task_ids)},
        "pool": {},
    }
    plain.close()
    if env_name in web.WEB_ENVS:
        result.update(web.web_figures(env_name, task_ids, steps))  # observation tokens, memory per browser
    for count in workers:
        episodes = count * EPISODES_PER_WORKER.get(env_name, 2)
        batches = max(5, steps // episodes)
        with EnvPool(env_name, kwargs, num_workers=count, step_timeout_s=120) as pool:
            pool.reset([task_ids[0]] * episodes)  # warm: start every worker and env instance untimed
            pool.close_episodes(pool.open_episodes)  # instances stay in their workers for reuse
            rates = [_pooled(pool, env_name, task_ids, episodes, batches, helper) for _ in range(repeats)]
        result["pool"][str(count)] = {"steps_per_s": _median(rates), "episodes_per_batch": episodes}

    def over_http(urls: list[str]) -> dict[str, Any]:
        client = AgentGymHTTPEnv(base_url=urls[0], env_name=env_name)
        client.reset(task_ids[0])
        rate = _median([_sequential(client, env_name, task_ids, steps, helper) for _ in range(repeats)])
        client.close()
        return {"steps_per_s": rate, "clients": 1}

    def over_fleet(urls: list[str]) -> dict[str, Any]:
        episodes = FLEET_WORKERS * FLEET_EPISODES_PER_WORKER
        kwargs = {"base_url": ",".join(urls), "env_name": env_name}
        with EnvPool("agentgym_http", kwargs, num_workers=FLEET_WORKERS, step_timeout_s=120) as pool:
            pool.reset([task_ids[0]] * episodes)  # warm: every worker, client and server-side env
            pool.close_episodes(pool.open_episodes)
            batches = max(5, steps // episodes)
            rates = [_pooled(pool, env_name, task_ids, episodes, batches, helper) for _ in range(repeats)]
        return {"steps_per_s": _median(rates), "servers": len(urls), "env_workers": FLEET_WORKERS,
                "episodes_per_batch": episodes}

    result["http"] = _with_servers(env_name, 1, over_http)
    result["http_fleet"] = {str(n): _with_servers(env_name, n, over_fleet) for n in (1, 3)}
    return result


def main() -> None:
    names = [n for n in registered_environments() if n != "agentgym_http" and n not in NEEDS_DEPLOYMENT]
    parser = argparse.ArgumentParser(description="env steps/s: in-process, pool (1/2/4 workers), HTTP")
    parser.add_argument("--envs", default=",".join(names))
    parser.add_argument("--steps", type=int, default=200, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    chosen = [n for n in args.envs.split(",") if n]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown environments {unknown}; choose from {names}")
    workers = [int(w) for w in args.workers.split(",")]
    results: dict[str, Any] = {}
    for name in chosen:
        start = time.perf_counter()
        results[name] = bench_env(name, args.steps, args.repeats, workers)
        results[name]["setup"] = {
            "cpu_count": os.cpu_count(),
            "steps_per_repeat": args.steps,
            "repeats": args.repeats,
            "wall_s": round(time.perf_counter() - start, 1),
        }
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "task_ids"}), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(out.read_text()) if out.is_file() else {}  # envs not measured now keep their entries
    out.write_text(json.dumps({**earlier, **results}, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
