"""Our env server: any registered environment over the AgentGym env-server protocol.

Run it with ``python -m launch.serve_env --env=textcraft --port=36001``. Same routes and JSON shapes as the
original AgentGym servers, which is what their clients index:

    GET  /                       -> "This is environment <name>."
    POST /create   {}            -> {"id": int}
    POST /reset    {"id", "data_idx"} -> {"id", "observation", "reward", "score", "done", "deleted", "info"}
    POST /step     {"id", "action"}   -> {"observation", "reward", "score", "done", "info"}
    GET  /observation?id=        -> the last observation (a bare JSON string)
    POST /close    {"id"}        -> true / false
    GET  /instruction, GET /tasks?split=  (ours, so a client needs nothing else)

As in the original, application errors (unknown id, step before reset, bad task id) are HTTP 200 with
``{"error": "..."}``; malformed requests are 422 with FastAPI's ``{"detail": [...]}``. ``info["success"]`` carries
the environment's own verdict. Ids start at a random offset per server start.
"""

import itertools
import json
import secrets
import threading
from typing import Any, Callable

from environments.base import Environment, make_env


def _jsonable(value: Any) -> Any:
    """``value`` if JSON can carry it, else its ``repr`` (env info dicts may hold arbitrary objects)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_jsonable(v) for v in value]
        return repr(value)


class _Slot:
    """One environment instance behind the server, with its own lock and last answer."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.lock = threading.Lock()
        self.observation = "Environment not initialized; call /reset first"
        self.started = False


class EnvServer:
    """The state behind the HTTP routes: id -> environment instance."""

    def __init__(self, env_name: str, env_factory: Callable[[], Environment], bare_actions: bool = False) -> None:
        self.env_name = env_name
        self.bare_actions = bare_actions
        self._factory = env_factory
        self._slots: dict[int, _Slot] = {}
        # Ids start at a random offset, so after a server restart an old client's id names no environment
        # (and gets "not valid") instead of silently driving another client's episode.
        self._ids = itertools.count(secrets.randbelow(2**40) * 1024)
        self._lock = threading.Lock()
        self._describer: Environment | None = None

    def _slot(self, env_id: int) -> _Slot:
        slot = self._slots.get(env_id)
        if slot is None:
            raise LookupError(f"The id {env_id} is not valid.")
        return slot

    def create(self) -> dict[str, Any]:
        env = self._factory()
        with self._lock:
            env_id = next(self._ids)
            self._slots[env_id] = _Slot(env)
        return {"id": env_id}

    def reset(self, env_id: int, data_idx: int) -> dict[str, Any]:
        slot = self._slot(env_id)
        with slot.lock:
            observation, info = slot.env.reset(data_idx)
            slot.observation, slot.started = observation, True
        return {
            "id": env_id,
            "observation": observation,
            "reward": 0.0,
            "score": 0.0,
            "done": False,
            "deleted": False,
            "info": _jsonable(info),
        }

    def step(self, env_id: int, action: str) -> dict[str, Any]:
        slot = self._slot(env_id)
        with slot.lock:
            if not slot.started:
                raise LookupError(f"The environment {env_id} has not been reset; call /reset first.")
            result = slot.env.step(f"Action:\n{action}" if self.bare_actions else action)
            slot.observation = result.observation
        info = dict(result.info)
        info.setdefault("success", result.reward >= 1.0)  # what an in-process rollout counts (rollout._success)
        return {
            "observation": result.observation,
            "reward": result.reward,
            "score": result.reward,
            "done": result.done,
            "info": _jsonable(info),
        }

    def observation(self, env_id: int) -> str:
        return self._slot(env_id).observation

    def close(self, env_id: int) -> bool:
        with self._lock:
            slot = self._slots.pop(env_id, None)
        if slot is None:
            return False
        with slot.lock:
            slot.env.close()
        return True

    def describe(self) -> Environment:
        with self._lock:
            if self._describer is None:
                self._describer = self._factory()
            return self._describer

    def close_all(self) -> None:
        with self._lock:
            slots, self._slots = list(self._slots.values()), {}
            describer, self._describer = self._describer, None
        for env in [s.env for s in slots] + ([describer] if describer else []):
            env.close()


def answer_or_error(call: Callable[[], Any]) -> Any:
    """``call()``, or the original servers' HTTP-200 ``{"error": ...}`` payload when it raises."""
    try:
        return call()
    except LookupError as error:  # unknown id and the like (a KeyError gives the bare key, as the originals do)
        return {"error": str(error.args[0]) if error.args else str(error)}
    except Exception as error:  # noqa: BLE001 - reported as the original does: HTTP 200 + "error"
        return {"error": f"{type(error).__name__}: {error}"}


def build_app(env_name: str, env_kwargs: dict[str, Any] | None = None, bare_actions: bool = False) -> Any:
    """A FastAPI app serving ``env_name`` (built with ``env_kwargs``) over the AgentGym protocol.

    Our client sends the agent's whole turn and the environment parses it. The original AgentGym
    clients parse the action themselves and send only it; with ``bare_actions=True`` the server puts
    ``Action:`` in front of each action so that our parsers accept what those clients send.
    """
    import contextlib

    import fastapi
    import pydantic

    make_env(env_name, **(env_kwargs or {})).close()  # fail now, with the registry's message, if unknown
    server = EnvServer(env_name, lambda: make_env(env_name, **(env_kwargs or {})), bare_actions)

    class CreateBody(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="ignore")  # the original clients send extra keys

    class ResetBody(pydantic.BaseModel):
        id: int
        data_idx: int = 0

    class StepBody(pydantic.BaseModel):
        id: int
        action: str

    class CloseBody(pydantic.BaseModel):
        id: int

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):  # noqa: ANN202
        yield
        server.close_all()

    app = fastapi.FastAPI(title=f"agentgym-jax {env_name} env server", lifespan=lifespan)
    app.state.env_server = server

    @app.get("/")
    def hello() -> str:
        return f"This is environment {env_name}."

    @app.post("/create")
    def create(body: CreateBody | None = None) -> Any:
        return answer_or_error(server.create)

    @app.post("/reset")
    def reset(body: ResetBody) -> Any:
        return answer_or_error(lambda: server.reset(body.id, body.data_idx))

    @app.post("/step")
    def step(body: StepBody) -> Any:
        return answer_or_error(lambda: server.step(body.id, body.action))

    @app.get("/observation")
    def observation(id: int) -> Any:  # noqa: A002 - the protocol's name
        return answer_or_error(lambda: server.observation(id))

    @app.post("/close")
    def close(body: CloseBody) -> Any:
        return answer_or_error(lambda: server.close(body.id))

    @app.get("/instruction")
    def instruction() -> Any:
        return answer_or_error(lambda: server.describe().instruction())

    @app.get("/tasks")
    def tasks(split: str) -> Any:
        return answer_or_error(
            lambda: [
                {"task_id": t.task_id, "split": t.split, "subtask": t.subtask} for t in server.describe().tasks(split)
            ]
        )

    return app
