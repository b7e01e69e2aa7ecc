"""Web env figures for ``benchmarks/envs.py``: scripted turns, observation tokens per step, memory per browser.

    python -m benchmarks.envs --envs=miniwob,webarena_local --steps=60 --repeats=2

Turns need no element ids, so they can be planned from the reset info alone: Corner Shop (``webarena_local``)
cycles through navigations (``goto`` a category and a search, ``scroll``, ``go_back``), MiniWoB++ through
``press [Tab]`` and scrolls (clicks would end its episodes). Every step renders the accessibility tree,
which is the main cost. Observation tokens are approximate (characters / 4, as the env's cap counts them).
Memory per browser is the proportional set size (PSS: shared pages split between the processes sharing them)
of the Playwright driver and all Chromium processes of one env, with 1 and with 3 envs open at once.
"""

from __future__ import annotations

import statistics
from typing import Any

import psutil

from environments.base import make_env
from environments.web.axtree import approx_tokens

WEB_ENVS = ("miniwob", "webarena_local")
_MINIWOB_CYCLE = ["press [Tab]", "scroll [down]", "press [Tab]", "scroll [up]"]


def turns(env_name: str, info: dict[str, Any], length: int) -> list[str]:
    """``length`` scripted turns for an episode that started with ``info``."""
    if env_name == "webarena_local":
        base = info["url"].rstrip("/")
        cycle = [f"goto [{base}/category/kitchen]", "scroll [down]", f"goto [{base}/search?q=tea]", "go_back"]
    else:
        cycle = _MINIWOB_CYCLE
    actions = (cycle * (length // len(cycle) + 1))[:length]
    return [f"Let's think step-by-step. In summary, the next action I will perform is ```{a}```" for a in actions]


def _pss_mib(pids: list[int]) -> tuple[float, float]:
    """(PSS, RSS) in MiB summed over ``pids``."""
    pss = rss = 0
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except psutil.Error:
            continue
        pss += getattr(info, "pss", info.rss)
        rss += info.rss
    return pss / 2**20, rss / 2**20


def observation_tokens(env_name: str, task_ids: list[int], steps: int) -> dict[str, Any]:
    """Approximate tokens of the reset and step observations over ``steps`` scripted steps."""
    env = make_env(env_name)
    counts: list[int] = []
    try:
        done = 0
        while done < steps:
            observation, info = env.reset(task_ids[done % len(task_ids)])
            counts.append(approx_tokens(observation))
            for turn in turns(env_name, info, min(10, steps - done)):
                counts.append(approx_tokens(env.step(turn).observation))
                done += 1
    finally:
        env.close()
    return {"median": statistics.median(counts), "mean": round(statistics.fmean(counts), 1), "max": max(counts),
            "observations": len(counts), "measure": "characters / 4"}


def browser_memory(env_name: str, task_ids: list[int], counts: tuple[int, ...] = (1, 3)) -> dict[str, Any]:
    """PSS and RSS per browser with ``n`` envs holding an episode each, for each n in ``counts``."""
    result: dict[str, Any] = {}
    for count in counts:
        envs = [make_env(env_name) for _ in range(count)]
        try:
            for index, env in enumerate(envs):
                observation, info = env.reset(task_ids[index % len(task_ids)])
                for turn in turns(env_name, info, 4):
                    env.step(turn)
            pids = [pid for env in envs for pid in env.browser.process_ids()]
            pss, rss = _pss_mib(pids)
            result[str(count)] = {"pss_mib_per_browser": round(pss / count, 1), "rss_mib_per_browser": round(rss / count, 1),
                                  "processes_per_browser": round(len(pids) / count, 1)}
        finally:
            for env in envs:
                env.close()
    return result


def web_figures(env_name: str, task_ids: list[int], steps: int) -> dict[str, Any]:
    """The web-only entries of an env's benchmark result."""
    return {"observation_tokens": observation_tokens(env_name, task_ids, steps),
            "memory_per_browser": browser_memory(env_name, task_ids)}
