"""A fleet of env servers: episodes spread over them, a dead server's episodes fail alone, and it comes back."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from environments.fleet import Fleet, FleetExhaustedError, parse_urls
from environments.workers import EnvPool
from tests.test_env_http import _free_port

REPO = Path(__file__).resolve().parents[1]


def _start(port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "launch.serve_env", "--env=textcraft", f"--port={port}"],
                               cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200:
                return process
        except requests.ConnectionError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "env server did not start"
        time.sleep(0.1)


def test_fleet_balances_caps_and_rotates():
    now = [0.0]
    fleet = Fleet(["a", "b", "c"], max_episodes_per_server=2, retry_after_s=10, clock=lambda: now[0])
    taken = [fleet.acquire() for _ in range(6)]
    assert collections.Counter(taken) == {"a": 2, "b": 2, "c": 2}
    with pytest.raises(FleetExhaustedError, match="max_episodes_per_server=2"):
        fleet.acquire()
    fleet.release("b")
    fleet.mark_down("b")
    with pytest.raises(FleetExhaustedError, match="1 of 3 out of rotation"):
        fleet.acquire()
    now[0] = 11.0
    assert fleet.acquire() == "b"
    assert parse_urls(" http://x:1/, http://y:2 ,http://x:1") == ["http://x:1", "http://y:2"]


def test_a_killed_server_fails_only_its_episodes_and_rejoins_after_restart():
    ports = [_free_port() for _ in range(3)]
    servers = {port: _start(port) for port in ports}
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    kwargs = dict(base_url=",".join(urls), retry_after_s=3.0, max_retries=1, backoff_s=0.05, timeout_s=10.0)
    try:
        with EnvPool("agentgym_http", kwargs, num_workers=1, step_timeout_s=60) as pool:
            tasks = [t.task_id for t in pool.tasks("test")[:6]]
            starts = pool.reset(tasks)
            assert collections.Counter(s.info["env_server"] for s in starts) == {url: 2 for url in urls}
            dead = urls[1]
            servers[ports[1]].kill()
            servers[ports[1]].wait()
            outs = pool.step({s.episode_id: "Action:\ninventory" for s in starts})
            failed = {e for e, o in outs.items() if o.error}
            on_dead = {s.episode_id for s in starts if s.info["env_server"] == dead}
            assert failed == on_dead
            assert all(dead in outs[e].error and "stopped answering" in outs[e].error for e in failed)
            assert all(not o.error and o.observation.startswith("Inventory") for e, o in outs.items() if e not in failed)
            pool.close_episodes(list(outs))
            again = pool.reset(tasks)  # the dead server is out of rotation: the other two take everything
            assert not any(o.error for o in again)
            assert {o.info["env_server"] for o in again} == {urls[0], urls[2]}
            pool.close_episodes([o.episode_id for o in again])
            servers[ports[1]] = _start(ports[1])
            time.sleep(3.5)
            back = pool.reset(tasks)
            assert collections.Counter(o.info["env_server"] for o in back) == {url: 2 for url in urls}
            outs = pool.step({o.episode_id: "Action:\ninventory" for o in back})
            assert not any(o.error for o in outs.values())
    finally:
        for process in servers.values():
            process.terminate()
            process.wait(timeout=20)
