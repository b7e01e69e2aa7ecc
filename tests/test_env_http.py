"""AgentGym HTTP protocol: our client against our server on loopback matches in-process play."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

from environments.agentgym_http import (
    AgentGymHTTPEnv,
    AgentGymProtocolError,
    AgentGymServerError,
    AgentGymUnavailableError,
)
from environments.base import make_env
from environments.textcraft.env import TextCraft
from environments.textcraft.solver import solve

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(module: str, *args: str, wait_s: float = 60.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Starts ``python -m <module> --port=<free port> <args>`` on 127.0.0.1, waits until ``GET /`` answers, yields
    ``(url, process)`` and stops the process afterwards."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", module, f"--port={port}", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if requests.get(url + "/", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert process.poll() is None, f"{module} exited during start-up"
            assert time.monotonic() < deadline, f"{module} did not start within {wait_s:g} s"
            time.sleep(0.1)
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=30)


def _serve(env: str, *flags: str) -> Iterator[str]:
    with running_server("launch.serve_env", f"--env={env}", *flags) as (url, _):
        yield url


@pytest.fixture(scope="module")
def textcraft_url() -> Iterator[str]:
    yield from _serve("textcraft")


def _turns(task_id: int) -> list[str]:
    env = TextCraft()
    plan = solve(env.book, env.goal_of(task_id))
    noise = ["no action in this turn", "Action:\ndance wildly", "Action:\nget 1 diamond pickaxe", "Action:\ninventory"]
    return noise + [f"Thought: step {i}\n\nAction:\n{a}" for i, a in enumerate(plan)]


def _play(env, task_id: int) -> list[tuple[str, float, bool]]:
    observation, _ = env.reset(task_id)
    trajectory = [(observation, 0.0, False)]
    for turn in _turns(task_id):
        result = env.step(turn)
        trajectory.append((result.observation, result.reward, result.done))
    return trajectory


@pytest.mark.parametrize("task_id", [0, 301, 500])
def test_http_trajectory_equals_in_process(textcraft_url: str, task_id: int) -> None:
    remote = make_env("agentgym_http", base_url=textcraft_url, env_name="textcraft")
    try:
        over_http = _play(remote, task_id)
    finally:
        remote.close()
    in_process = _play(TextCraft(), task_id)
    assert over_http == in_process
    assert over_http[-1][1:] == (1.0, True)
    assert "Could not execute dance wildly" in [obs for obs, _, _ in over_http]


def test_client_reads_instruction_and_tasks_from_our_server(textcraft_url: str) -> None:
    remote = AgentGymHTTPEnv(base_url=textcraft_url, env_name="textcraft")
    local = TextCraft()
    assert remote.instruction() == local.instruction()
    assert remote.tasks("test") == list(local.tasks("test"))
    assert len(remote.tasks("train")) == 436


def test_server_errors_are_http_200_payloads_and_client_raises(textcraft_url: str) -> None:
    answer = requests.post(textcraft_url + "/step", json={"id": 12345, "action": "x"}, timeout=5)
    assert answer.status_code == 200 and answer.json() == {"error": "The id 12345 is not valid."}
    missing = requests.post(textcraft_url + "/step", json={"id": 0}, timeout=5)
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "action"]
    created = requests.post(textcraft_url + "/create", json={}, timeout=5).json()
    assert requests.post(textcraft_url + "/close", json=created, timeout=5).json() is True
    assert requests.post(textcraft_url + "/close", json=created, timeout=5).json() is False

    client = AgentGymHTTPEnv(base_url=textcraft_url, env_name="textcraft")
    with pytest.raises(AgentGymServerError, match="out of range"):
        client.reset(10**6)
    with pytest.raises(AgentGymServerError, match="has not been reset"):
        AgentGymHTTPEnv(base_url=textcraft_url).step("Action:\ninventory")
    client._env_id = 98765  # as if the server had forgotten our env
    with pytest.raises(AgentGymServerError, match="The id 98765 is not valid"):
        client.step("Action:\ninventory")
    wrong_route = AgentGymHTTPEnv(base_url=textcraft_url + "/nothing-here")
    with pytest.raises(AgentGymProtocolError, match="HTTP 404"):
        wrong_route.reset(0)


def test_observation_route_matches_last_step(textcraft_url: str) -> None:
    client = AgentGymHTTPEnv(base_url=textcraft_url, env_name="textcraft")
    client.reset(7)
    result = client.step("Action:\ninventory")
    assert client.observation() == result.observation == "Inventory: You are not carrying anything."
    client.close()


def test_unreachable_server_retries_with_backoff_then_fails_clearly() -> None:
    client = AgentGymHTTPEnv(base_url=f"http://127.0.0.1:{_free_port()}", env_name="textcraft", max_retries=2, backoff_s=0.2)
    start = time.monotonic()
    with pytest.raises(AgentGymUnavailableError, match=r"after 3 attempt\(s\).*launch.serve_env --env=textcraft"):
        client.reset(0)
    assert 0.55 < time.monotonic() - start < 5  # back-off 0.2 s + 0.4 s


def test_bare_actions_flag_serves_original_style_clients() -> None:
    for url in _serve("textcraft", "--bare_actions"):
        env_id = requests.post(url + "/create", json={"minecraft_dir": "ignored"}, timeout=5).json()["id"]
        requests.post(url + "/reset", json={"id": env_id, "data_idx": 0}, timeout=5)
        answer = requests.post(url + "/step", json={"id": env_id, "action": "get 1 acacia logs"}, timeout=5).json()
        assert answer["observation"] == "Got 1 acacia logs" and answer["done"] is False


def test_a_restarted_server_does_not_reuse_an_old_clients_id() -> None:
    from environments.agentgym_server import EnvServer

    first = EnvServer("textcraft", TextCraft)
    old_id = first.create()["id"]
    first.reset(old_id, 0)
    restarted = EnvServer("textcraft", TextCraft)  # a new process starts a new server object
    new_ids = [restarted.create()["id"] for _ in range(3)]
    assert old_id not in new_ids and len(set(new_ids)) == 3
    with pytest.raises(LookupError, match=f"The id {old_id} is not valid"):
        restarted.step(old_id, "inventory")
    first.close_all()
    restarted.close_all()
