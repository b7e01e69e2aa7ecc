"""Playing the original AgentGym servers: action extraction, reward reading, and runs pointed at a URL."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from environments import server_profiles as sp
from environments.agentgym_http import AgentGymHTTPEnv, AgentGymProtocolError, AgentGymUnavailableError
from environments.base import Environment, StepResult, Task
from environments.remote import RemoteConfigError, remote_env_spec
from environments.textcraft.env import TextCraft
from environments.textcraft.solver import solve
from tests.test_env_http import _free_port, _serve

REPO = Path(__file__).resolve().parents[1]
REACT = "Thought: I should act now.\n\nAction:\n{}"


@pytest.fixture(scope="module")
def babyai_original() -> str:
    yield from _serve("babyai", "--replica")


@pytest.fixture(scope="module")
def textcraft_original() -> str:
    yield from _serve("textcraft", "--replica")


# -- extraction and reward reading (no server) ---------------------------------------------------------------


def test_react_extraction_follows_the_original_clients():
    assert sp.react_one_line("Thought: need a blue orchid first.\n\nAction:\nget 1 blue orchid").action == \
        "get 1 blue orchid"
    assert sp.react_one_line("Action: craft 1 stick using 2 bamboo!\nmore text").action == "craft 1 stick using 2 bamboo"
    two = sp.react_one_line("Action:\nget 1 a\nAction:\nget 1 b")
    assert two.action is None and "Only one 'Action'" in two.local_observation
    assert sp.react_one_line("I will look around").action is None
    assert sp.react_free_text("Thought: x\nAction:\nfocus on\n  red wire").action == "focus on\n  red wire"
    assert sp.search_tags("<think>hm</think> <search>capital of France</search> then <answer>x</answer>").action == \
        "<search>capital of France</search>"
    assert sp.search_tags("no tags").action == "no tags"  # the server answers the invalid format itself
    assert sp.webarena_backticks("In summary, the next action I will perform is ```click [12]```").action == "click [12]"
    assert "triple backticks" in sp.webarena_backticks("click [12]").local_observation


def test_babyai_running_score_is_read_into_zero_one():
    # A success worth <= 0.5 leaves the original's done false and its score keeps growing with each step.
    bodies = [{"reward": 0.0, "score": 0.0, "done": False}, {"reward": 0.38, "score": 0.38, "done": False},
              {"reward": 0.38, "score": 0.76, "done": False}, {"reward": 0.35, "score": 1.11, "done": False}]
    previous, seen = 0.0, []
    for body in bodies:
        outcome = sp.babyai_first_success(body, previous)
        previous = outcome.score
        seen.append((outcome.score, outcome.done, outcome.success))
    assert seen == [(0.0, False, False), (0.38, True, True), (0.38, True, True), (0.38, True, True)]


def test_sciworld_and_webarena_scales():
    assert sp.sciworld_score({"score": 45, "done": False}, 0.0) == sp.Outcome(0.45, False, False)
    assert sp.sciworld_score({"score": 100, "done": True}, 0.0) == sp.Outcome(1.0, True, True)
    assert sp.sciworld_score({"score": -100, "done": True}, 0.0) == sp.Outcome(0.0, True, False)
    assert sp.webarena_terminal({"reward": 1.0, "terminated": False, "truncated": False}, 0.0).score == 0.0
    assert sp.webarena_terminal({"reward": 1.0, "terminated": True}, 0.0) == sp.Outcome(1.0, True, True)
    with pytest.raises(ValueError, match="known profiles: agentgym-jax, babyai"):
        sp.get_profile("alfworld")


# -- against the replica servers -----------------------------------------------------------------------------


def test_original_textcraft_scripted_react_episode_reaches_reward_one(textcraft_original):
    env = AgentGymHTTPEnv(textcraft_original, profile="textcraft")
    task = env.tasks("test")[0]
    observation, _ = env.reset(task.task_id)
    assert observation.startswith("Crafting commands:")
    plan = solve(TextCraft().book, TextCraft().goal_of(task.task_id))
    results = [env.step(REACT.format(action)) for action in plan]
    assert [r.reward for r in results] == [0.0] * (len(plan) - 1) + [1.0]
    assert results[-1].done and results[-1].info["success"] and results[-1].info["action_sent"] == plan[-1]
    # Without the profile the whole turn goes to the server, which cannot execute it (the reported bug).
    raw = AgentGymHTTPEnv(textcraft_original, profile="agentgym-jax", instruction="x",
                          tasks_by_split={"test": [task]})
    raw.reset(task.task_id)
    assert raw.step(REACT.format(plan[0])).observation.startswith("Could not execute Thought")
    env.close(), raw.close()


def test_original_babyai_scripted_react_episode_scores_0_8875(babyai_original):
    env = AgentGymHTTPEnv(babyai_original, profile="babyai")
    observation, _ = env.reset(0)  # BabyAI-GoToRedBallGrey-v0, seed 0
    assert "Your goal: go to the red ball" in observation
    look = env.step(REACT.format("check available actions"))
    assert (look.reward, look.done, look.info["action_sent"]) == (0.0, False, "check available actions")
    two = env.step("Action:\nturn left\nAction:\nturn right")
    assert two.info["action_sent"] is None and "Only one 'Action'" in two.observation
    final = env.step(REACT.format("go to red ball 1"))
    assert (final.reward, final.done, final.info["success"]) == (0.8875, True, True)
    assert final.info["server_score"] == 0.8875
    env.close()


def test_instruction_and_tasks_come_from_the_local_twin_and_ours_hint_when_missing(babyai_original):
    env = AgentGymHTTPEnv(babyai_original, profile="babyai", local_env_kwargs={"instruction_style": "brief"})
    assert "Action:" in env.instruction()
    assert {t.split for t in env.tasks("test")} == {"test"} and len(env.tasks("train")) > len(env.tasks("test"))
    ours = AgentGymHTTPEnv(babyai_original)  # the agentgym-jax profile asks the server, which has no /instruction
    with pytest.raises(AgentGymProtocolError, match="does not serve /instruction.*profile='babyai'"):
        ours.instruction()


def test_create_is_not_retried_after_it_may_have_run(babyai_original):
    calls = []

    class CountingSession(requests.Session):
        def request(self, method, url, **kwargs):  # noqa: ANN001, ANN003
            calls.append(url.rsplit("/", 1)[-1])
            if url.endswith("/create"):
                raise requests.ReadTimeout("read timed out")
            return super().request(method, url, **kwargs)

    env = AgentGymHTTPEnv(babyai_original, profile="babyai", session=CountingSession(), backoff_s=0.01,
                          retry_after_s=0.0)  # its own fleet: the server is not out of rotation for other tests
    with pytest.raises(AgentGymUnavailableError, match="create failed after 1 attempt"):
        env.reset(0)
    assert calls == ["create"]


class _FarmingEnv(Environment):
    """Reaches its goal with a small reward and keeps paying it: the running-score case."""

    name = "farming"

    def instruction(self) -> str:
        return "farm"

    def tasks(self, split: str):
        return [Task(0, split, "x")]

    def reset(self, task_id: int):
        return "start", {}

    def step(self, action_text: str) -> StepResult:
        return StepResult("at the goal", 0.38, True, {"step_reward": 0.38})


def test_running_score_server_cannot_be_farmed_through_the_client():
    import uvicorn

    from environments.agentgym_replica import build_replica_app

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_replica_app("babyai", _FarmingEnv), host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        raw = requests.Session()
        env_id = raw.post(f"{url}/create").json()["id"]
        raw.post(f"{url}/reset", json={"id": env_id, "data_idx": 0})
        scores = [raw.post(f"{url}/step", json={"id": env_id, "action": "x"}).json()["score"] for _ in range(3)]
        assert scores == pytest.approx([0.38, 0.76, 1.14])  # the original's running sum, done still false
        env = AgentGymHTTPEnv(url, profile="babyai", instruction="farm", tasks_by_split={"test": [Task(0, "test", "x")]})
        env.reset(0)
        rewards = [env.step("Action:\nx") for _ in range(3)]
        assert [(r.reward, r.done) for r in rewards] == [(0.38, True)] * 3
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_remote_spec_detects_the_server_kind(babyai_original, tmp_path):
    name, kwargs = remote_env_spec(babyai_original, "babyai", "", {"num_test_seeds": 1, "timeout_s": 5.0})
    assert name == "agentgym_http" and kwargs["profile"] == "babyai"
    assert kwargs["local_env_kwargs"] == {"num_test_seeds": 1} and kwargs["timeout_s"] == 5.0
    with pytest.raises(RemoteConfigError, match="not an http"):
        remote_env_spec("127.0.0.1:1", "babyai")
    with pytest.raises(RemoteConfigError, match="cannot be reached"):
        remote_env_spec(f"http://127.0.0.1:{_free_port()}", "babyai")


def _launch(module: str, url: str, model: Path, workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    # configs/cpu_demo.py as shipped; the policy is scripted by a response prefix that already holds the action.
    command = [
        sys.executable, "-m", module, "--config=configs/cpu_demo.py", f"--config.env.remote={url}",
        f"--config.model.path={model}", "--config.rollout.response_prefix=Action:\ngo to red ball 1\n",
        "--config.rollout.max_turn_tokens=1", "--config.data.test_tasks=4", "--config.env.num_workers=1",
        "--config.env.kwargs.levels=('BabyAI-GoToRedBallGrey-v0',)", "--config.eval.batch_tasks=4",
        "--config.train.progress_bars=False", "--config.train.report_path=", "--config.algo.trainable_layers=0",
        "--config.rollout.max_trajectory_tokens=1024",
        # the test's own task draw and horizon (the scripted action reaches the ball on some of these tasks)
        "--config.env.kwargs.num_test_seeds=10", "--config.eval.horizon=2", *extra,
    ]
    if module == "launch.train":
        command += [f"--workdir={workdir}", "--config.train.steps=1", "--config.data.tasks_per_step=2",
                    "--config.data.samples_per_task=2", "--config.data.dynamic_sampling=False",
                    "--config.algo.minibatch_size=4", "--config.algo.microbatch_size=2",
                    "--config.train.export_final=False", "--config.train.eval_before=False"]
    else:
        command += [f"--checkpoint={model}", f"--out={workdir}"]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_train_and_eval_against_an_original_server_from_the_command_line(babyai_original, tmp_path):
    from tests.tiny_models import save_tiny_chat_model

    model = save_tiny_chat_model(tmp_path / "model")
    trained = _launch("launch.train", babyai_original, model, tmp_path / "run")
    assert trained.returncode == 0, trained.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["eval_after"]["overall"]["success_rate"] > 0
    assert report["eval_after"]["settings"]["env_profile"] == "babyai"
    evaluated = _launch("launch.eval", babyai_original, model, tmp_path / "eval", "--config.train.record_rollouts=True")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert summary["overall"]["success_rate"] > 0 and summary["settings"]["env_server"] == babyai_original
    from agentgym_jax.rollout_records import read_rollouts

    recorded = read_rollouts(tmp_path / "eval" / "rollouts", kind="eval_test")
    assert len(recorded) == 4 and sum(r["success"] for r in recorded) / 4 == summary["overall"]["success_rate"]
