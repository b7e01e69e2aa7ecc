"""Stand-ins for the original AgentGym TextCraft and BabyAI env servers, for tests and offline dry runs.

    python -m launch.serve_env --env=babyai --replica --port=36002

They answer as the originals were observed to (``../shared/reference/agentgym-rl.md``, appendix), on top of our
environments with the same task-id spaces: bare actions only (no ``Action:`` parsing), every application error
as HTTP 200 ``{"error": ...}``, bare ``true``/``false`` from ``/close``, ids counting from 0 per start.

- TextCraft: ``/create`` needs a JSON body and starts task ``id``; ``/reset`` answers with ``id``; rewards are
  the integers 0/1; steps are still accepted after ``done``; ``/commands`` and ``/goal`` fail with HTTP 500.
- BabyAI: ``/create`` takes no body and starts nothing; ``/reset`` needs ``data_idx`` and answers without
  ``id``; actions are lower-cased and stripped; ``score`` is the running sum of the step rewards; ``done`` is
  forced false when the step's reward is <= 0.5 and true when it is 1; a step after ``done`` is an error.

An environment may report the raw step reward as ``info["step_reward"]``; otherwise the change of its outcome
score is the step reward (what minigrid pays on the step that reaches the goal).
"""
# No ``from __future__ import annotations``: FastAPI must see the request models, defined locally, as classes.


import itertools
import threading
from typing import Any, Callable

from environments.agentgym_server import answer_or_error
from environments.base import Environment, make_env

REPLICAS = ("babyai", "textcraft")


class _Replica:
    def __init__(self, env_factory: Callable[[], Environment], unrecognized: Callable[[str], str]) -> None:
        self.factory = env_factory
        self.unrecognized = unrecognized
        self.envs: dict[int, dict[str, Any]] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()

    def new(self) -> int:
        with self.lock:
            env_id = next(self.ids)
            self.envs[env_id] = {"env": self.factory(), "started": False, "done": False, "score": 0.0,
                                 "outcome": 0.0, "observation": "Environment not initialized"}
        return env_id

    def get(self, env_id: int) -> dict[str, Any]:
        if env_id not in self.envs:
            raise LookupError(f"The id {env_id} is not valid.")
        return self.envs[env_id]

    def start(self, slot: dict[str, Any], data_idx: int) -> str:
        env = slot["env"]
        count = len(env.tasks("train")) + len(env.tasks("test"))
        observation, _ = env.reset(data_idx % count if count else data_idx)
        slot.update(started=True, done=False, score=0.0, outcome=0.0, observation=observation)
        return observation

    def play(self, slot: dict[str, Any], action: str) -> tuple[str, float, bool]:
        if "\n" in action or "action:" in action.lower():  # a whole ReAct turn is no command to the originals
            return self.unrecognized(action), 0.0, slot["done"]
        result = slot["env"].step(f"Action:\n{action}")
        step_reward = float(result.info.get("step_reward", result.reward - slot["outcome"]))
        slot["outcome"], slot["observation"] = result.reward, result.observation
        return result.observation, step_reward, result.done

    def close(self, env_id: int) -> bool:
        with self.lock:
            slot = self.envs.pop(env_id, None)
        if slot is None:
            return False
        slot["env"].close()
        return True


def build_replica_app(kind: str, env_factory: Callable[[], Environment] | None = None) -> Any:
    """A FastAPI app answering like the original ``kind`` server (``babyai`` or ``textcraft``)."""
    import fastapi
    import pydantic

    if kind not in REPLICAS:
        raise ValueError(f"no replica of the original {kind!r} server; replicas exist for {list(REPLICAS)}")
    messages = {"textcraft": lambda action: f"Could not execute {action}",
                "babyai": lambda action: "The action is not recognized. Please check valid actions."}
    replica = _Replica(env_factory or (lambda: make_env(kind)), messages[kind])
    app = fastapi.FastAPI(title=f"replica of the original AgentGym {kind} server")

    class Anything(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="ignore")

    class TextCraftReset(pydantic.BaseModel):
        id: int
        data_idx: int = 0

    class BabyAIReset(pydantic.BaseModel):
        id: int
        data_idx: int

    class Step(pydantic.BaseModel):
        id: int
        action: str

    class Close(pydantic.BaseModel):
        id: int

    @app.get("/")
    def hello() -> str:
        return f"This is environment {'TextCraft' if kind == 'textcraft' else 'BabyAI'}."

    @app.post("/close")
    def close(body: Close) -> Any:
        return answer_or_error(lambda: replica.close(body.id))

    if kind == "textcraft":

        @app.post("/create")
        def tc_create(body: Anything) -> Any:  # a JSON body is required (422 without); its keys are ignored
            def create() -> Any:
                env_id = replica.new()
                observation = replica.start(replica.get(env_id), env_id)
                return {"id": env_id, "observation": observation, "done": False, "reward": 0}
            return answer_or_error(create)

        @app.post("/reset")
        def tc_reset(body: TextCraftReset) -> Any:
            def reset() -> Any:
                observation = replica.start(replica.get(body.id), body.data_idx)
                return {"id": body.id, "observation": observation, "done": False, "reward": 0}
            return answer_or_error(reset)

        @app.post("/step")
        def tc_step(body: Step) -> Any:
            def step() -> Any:
                slot = replica.get(body.id)
                observation, reward, done = replica.play(slot, body.action)
                slot["done"] = slot["done"] or done
                return {"observation": observation, "reward": int(reward >= 1.0), "done": slot["done"]}
            return answer_or_error(step)

        @app.get("/observation")
        def tc_observation(id: int) -> Any:  # noqa: A002 - the protocol's name
            return answer_or_error(lambda: replica.get(id)["observation"])

        @app.get("/commands")
        def tc_commands() -> Any:
            raise RuntimeError("TextCraft_Wrapper has no get_commands")  # the original's HTTP 500

        @app.get("/goal")
        def tc_goal() -> Any:
            raise RuntimeError("TextCraft_Wrapper has no get_goal")

        return app

    def finished_guard(env_id: int) -> dict[str, Any]:
        slot = replica.get(env_id)
        if slot["done"]:
            raise LookupError(f"The task with environment {env_id} has finished.")
        return slot

    @app.post("/create")
    def ba_create() -> Any:
        return answer_or_error(lambda: {"id": replica.new()})

    @app.post("/reset")
    def ba_reset(body: BabyAIReset) -> Any:
        return answer_or_error(lambda: {"observation": replica.start(replica.get(body.id), body.data_idx),
                                        "reward": 0, "score": 0, "deleted": False, "done": False})

    @app.post("/step")
    def ba_step(body: Step) -> Any:
        def step() -> Any:
            slot = finished_guard(body.id)
            if not slot["started"]:
                raise KeyError(body.id)
            observation, reward, done = replica.play(slot, body.action.lower().strip())
            if reward <= 0.5:
                done = False
            if reward == 1:
                done = True
            slot["score"] += reward
            slot["done"] = done
            return {"observation": observation, "reward": reward, "score": slot["score"], "done": done}
        return answer_or_error(step)

    @app.get("/observation")
    def ba_observation(id: int) -> Any:  # noqa: A002 - the protocol's name
        def observe() -> Any:
            slot = finished_guard(id)
            return {"observation": slot["observation"], "reward": 0, "score": slot["score"], "done": slot["done"],
                    "deleted": False}
        return answer_or_error(observe)

    return app
