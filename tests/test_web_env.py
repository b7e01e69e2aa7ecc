"""Web envs in a real Chromium: scripted solutions pass the evaluators, wrong ones fail, failures stay in their
episode, the envs run through EnvPool and over the AgentGym HTTP protocol, and no browser process survives."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import psutil
import pytest

from environments.agentgym_http import AgentGymHTTPEnv
from environments.base import make_env
from environments.web import EpisodeFailed, scripted
from environments.web.browser import chromium_path
from environments.web.miniwob import MINIWOB_TASKS
from environments.workers import EnvPool
from tests.test_env_http import running_server

SEEN_BROWSER_PIDS: set[int] = set()  # every driver/Chromium process the tests saw; none may outlive the module

try:
    chromium_path()
except Exception as error:  # noqa: BLE001
    pytest.skip(f"no Chromium: {error}", allow_module_level=True)


def _remember(env) -> None:
    SEEN_BROWSER_PIDS.update(env.browser.process_ids())


def _miniwob_id(name: str, seed: int) -> int:
    return MINIWOB_TASKS.index(name) * 100 + seed


@pytest.fixture(scope="module")
def local_env():
    env = make_env("webarena_local")
    yield env
    _remember(env)
    env.close()


@pytest.fixture(scope="module")
def miniwob_env():
    env = make_env("miniwob", action_timeout_s=2.0)
    yield env
    _remember(env)
    env.close()


def _play(env, task_id: int, plan) -> list:
    observation, _ = env.reset(task_id)
    _remember(env)
    return list(scripted.run_plan(observation, plan + [("stop", "")], env.step))


# -- the local site: all three evaluator kinds, end to end ---------------------------------------------------


@pytest.mark.parametrize("task_id", range(8))
def test_local_site_scripted_solutions_pass_and_wrong_ones_fail(local_env, task_id):
    right = _play(local_env, task_id, scripted.LOCAL_PLANS[task_id])[-1]
    assert right.done and right.reward == 1.0 and right.info["success"], right.info
    wrong = _play(local_env, task_id, scripted.LOCAL_WRONG_PLANS[task_id])[-1]
    assert wrong.done and wrong.reward == 0.0 and not wrong.info["success"], wrong.info


def test_local_site_state_is_reset_between_episodes(local_env):
    _play(local_env, 5, scripted.LOCAL_PLANS[5])  # subscribes
    # The wrong plan only presses Save: it passes only if the subscription leaked from the episode before.
    assert _play(local_env, 5, scripted.LOCAL_WRONG_PLANS[5])[-1].reward == 0.0


def test_step_limit_grades_the_episode(local_env):
    local_env.max_steps = 2
    try:
        observation, _ = local_env.reset(2)
        first = local_env.step(scripted.turn(observation, scripted.LOCAL_PLANS[2][0]))  # searches for tea
        assert not first.done
        last = local_env.step("```scroll [down]```")
        assert last.done and last.reward == 1.0 and last.info["step_limit"] == 2
    finally:
        local_env.max_steps = 0


def test_local_site_login_state_is_used(local_env):
    observation, _ = local_env.reset(5)
    assert "My account (emma)" in observation and "Sign in" not in observation
    observation, _ = local_env.reset(0)
    assert "Sign in" in observation  # tasks without storage_state start logged out


# -- MiniWoB++: the task's own reward --------------------------------------------------------------------


@pytest.mark.parametrize("name", scripted.MINIWOB_SOLVABLE)
def test_miniwob_scripted_solutions_earn_the_pages_reward(miniwob_env, name):
    task_id = _miniwob_id(name, 4)
    observation, info = miniwob_env.reset(task_id)
    plan = scripted.miniwob_plan(name, info["objective"], observation)
    final = list(scripted.run_plan(observation, plan, miniwob_env.step))[-1]
    assert final.done and final.reward == 1.0 and final.info["success"], (name, final.info)
    observation, info = miniwob_env.reset(task_id)
    wrong = scripted.miniwob_plan(name, info["objective"], observation, wrong=True) + [("stop", "")]
    final = list(scripted.run_plan(observation, wrong, miniwob_env.step))[-1]
    assert final.done and final.reward < 1.0 and not final.info["success"], (name, final.info)


def test_miniwob_seeds_are_reproducible_and_splits_disjoint(miniwob_env):
    first, again, other = (miniwob_env.reset(_miniwob_id("click-button", seed))[0] for seed in (7, 7, 8))
    assert first == again and first != other
    train, test = miniwob_env.tasks("train"), miniwob_env.tasks("test")
    assert not {t.task_id for t in train} & {t.task_id for t in test} and len(test) * 4 == len(train)


# -- invalid actions and browser actions ---------------------------------------------------------------------


def test_bad_actions_are_observations_that_say_why(local_env):
    local_env.reset(0)
    cases = {"click [3]": "inside triple backticks", "```click [999999]```": "no element with id [999999]",
             "```tab_focus [5]```": "there is no tab 5", "```dance [1]```": "unknown action 'dance'",
             "```goto [notaurl]```": "could not open notaurl"}
    for turn, reason in cases.items():
        result = local_env.step(turn)
        assert not result.done and reason in result.observation and "OBSERVATION:" in result.observation, turn
        assert not result.info["action_valid"]


def test_tabs_and_history(local_env):
    observation, info = local_env.reset(0)
    shop = "http://cornershop.com"  # the agent sees stable site names, not 127.0.0.1:<port>
    assert info["url"] == shop + "/" and "127.0.0.1" not in observation
    local_env.step(scripted.turn(observation, ("click", "link", "Garden")))
    assert local_env.step("```go_back```").observation.count("URL: " + shop) == 1
    assert "/category/garden" in local_env.step("```go_forward```").info["url"]
    result = local_env.step("```new_tab```")
    assert "Tab 0: Garden - Corner Shop | Tab 1 (current): " in result.observation
    result = local_env.step(f"```goto [{shop}/category/home]```")
    assert "Walnut Desk Organizer" in result.observation and "PREVIOUS ACTION: goto" in result.observation
    assert "Tab 0 (current): Garden" in local_env.step("```tab_focus [0]```").observation
    result = local_env.step("```close_tab```")
    assert "Tab 0 (current): Home - Corner Shop" in result.observation and "Tab 1" not in result.observation
    assert "/category/home" in local_env.step("```scroll [down]```").info["url"]


def test_step_after_the_end_is_refused(local_env):
    _play(local_env, 2, scripted.LOCAL_PLANS[2])
    with pytest.raises(Exception, match="call reset"):
        local_env.step("```click [1]```")


# -- failures end only their own episode ---------------------------------------------------------------------


@pytest.fixture()
def silent_server():
    """A TCP server that accepts connections and never answers: a page that never loads."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


def test_a_page_that_never_loads_fails_only_its_episode(silent_server, tmp_path):
    configs = [{"task_id": 0, "sites": ["slow"], "start_url": "__SLOW__/", "intent": "wait", "storage_state": None,
                "eval": {"eval_types": ["url_match"], "reference_url": "__SLOW__/"}},
               {"task_id": 1, "sites": ["slow"], "start_url": "data:text/html,<button>fine</button>", "intent": "ok",
                "storage_state": None, "eval": {"eval_types": ["url_match"], "reference_url": "data:"}}]
    (tmp_path / "tasks.json").write_text(json.dumps(configs))
    env = make_env("webarena", config_file=str(tmp_path / "tasks.json"), sites={"slow": silent_server},
                   page_load_timeout_s=1.5)
    try:
        start = time.monotonic()
        with pytest.raises(EpisodeFailed, match="did not load within the page-load timeout of 1.5 s"):
            env.reset(0)
        assert time.monotonic() - start < 15
        observation, _ = env.reset(1)
        assert "button 'fine'" in observation
        assert env.step("```stop []```").reward == 1.0
        _remember(env)
    finally:
        env.close()


def test_a_killed_renderer_fails_only_its_episode(miniwob_env):
    observation, _ = miniwob_env.reset(_miniwob_id("click-test", 1))
    renderers = miniwob_env.browser.renderer_pids()
    assert renderers
    for pid in renderers:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(EpisodeFailed, match="crash"):
        for _ in range(3):  # the crash event may arrive a moment after the kill
            miniwob_env.step(scripted.turn(observation, ("click", "button", "Click Me!")))
            time.sleep(0.2)
    observation, info = miniwob_env.reset(_miniwob_id("click-test", 2))
    final = list(scripted.run_plan(observation, [("click", "button", "Click Me!")], miniwob_env.step))[-1]
    assert final.reward == 1.0


def test_a_hung_renderer_kills_the_browser_and_the_next_episode_gets_a_new_one(tmp_path):
    page = "data:text/html,<button onclick='while(true){}'>freeze</button>"
    config = [{"task_id": 0, "sites": [], "start_url": page, "intent": "freeze", "storage_state": None,
               "eval": {"eval_types": ["url_match"], "reference_url": "data:"}}]
    (tmp_path / "tasks.json").write_text(json.dumps(config))
    env = make_env("webarena", config_file=str(tmp_path / "tasks.json"), action_timeout_s=1.0, call_timeout_s=4.0)
    try:
        observation, _ = env.reset(0)
        first = env.browser.process_ids()
        SEEN_BROWSER_PIDS.update(first)
        with pytest.raises(EpisodeFailed, match="did not answer within 4 s"):
            env.step(scripted.turn(observation, ("click", "button", "freeze")))
            env.step("```scroll [down]```")
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in first)
        observation, _ = env.reset(0)
        assert "button 'freeze'" in observation and env.browser.process_ids()[0] != first[0]
        _remember(env)
    finally:
        env.close()


# -- worker pool and HTTP --------------------------------------------------------------------------------


def _browser_pids_under(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)
                if "chrom" in p.name() or "node" in p.name()]
    except psutil.Error:
        return []


def test_pool_runs_web_episodes_and_a_killed_worker_ends_only_its_episodes():
    with EnvPool("miniwob", {"tasks": ["click-test", "click-button"]}, num_workers=2, step_timeout_s=60) as pool:
        starts = pool.reset([1, 101])
        assert all(s.error is None for s in starts), [s.error for s in starts]
        by_worker = {pid: _browser_pids_under(pid) for pid in pool.worker_pids()}
        SEEN_BROWSER_PIDS.update(p for pids in by_worker.values() for p in pids)
        assert all(by_worker.values())
        victim = pool.worker_pids()[pool._owner[starts[0].episode_id]]
        os.kill(victim, signal.SIGKILL)
        survivor = starts[1]
        plan = scripted.miniwob_plan("click-button", survivor.info["objective"], survivor.observation)
        outcomes = pool.step({starts[0].episode_id: "```click [1]```",
                              survivor.episode_id: scripted.turn(survivor.observation, plan[0])})
        assert "worker process died" in outcomes[starts[0].episode_id].error
        assert outcomes[survivor.episode_id].error is None and outcomes[survivor.episode_id].reward == 1.0
        deadline = time.monotonic() + 15
        while any(psutil.pid_exists(p) for p in by_worker[victim]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in by_worker[victim] if psutil.pid_exists(p)], "Chromium outlived its killed worker"
        again = pool.reset([1])[0]
        assert again.error is None and "Click Me!" in again.observation
        SEEN_BROWSER_PIDS.update(p for pid in pool.worker_pids() for p in _browser_pids_under(pid))


def test_served_over_the_agentgym_http_protocol():
    with running_server("launch.serve_env", "--env=miniwob",
                        '--env_kwargs={"tasks": ["click-test", "enter-text"]}') as (url, server):
        client = AgentGymHTTPEnv(base_url=url, env_name="miniwob")
        assert "```" in client.instruction() and len(client.tasks("test")) == 40
        observation, info = client.reset(105)
        plan = scripted.miniwob_plan("enter-text", observation.split("OBJECTIVE: ")[1].splitlines()[0], observation)
        final = list(scripted.run_plan(observation, plan, client.step))[-1]
        assert final.done and final.reward == 1.0 and final.info["success"]
        SEEN_BROWSER_PIDS.update(_browser_pids_under(server.pid))
        client.close()


def test_no_browser_process_survives(local_env, miniwob_env):
    """Runs last in this module: after closing, every driver and Chromium process seen above is gone."""
    _remember(local_env)
    _remember(miniwob_env)
    local_env.close()
    miniwob_env.close()
    deadline = time.monotonic() + 15
    while True:
        alive = []
        for pid in SEEN_BROWSER_PIDS:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE and ("chrom" in proc.name() or "node" in proc.name()):
                    alive.append((pid, proc.name()))
            except psutil.Error:
                continue
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert SEEN_BROWSER_PIDS and not alive, f"browser processes left behind: {alive}"
