"""The AgentGym env-server protocol: a server for any of our environments, and a client for any server.

Server (FastAPI; run with ``python -m launch.serve_env --env=textcraft --port=36001``). Same routes and
JSON shapes as the original AgentGym servers, which is what their clients index:

    GET  /                       -> "This is environment <name>."
    POST /create   {}            -> {"id": int}
    POST /reset    {"id", "data_idx"} -> {"id", "observation", "reward", "score", "done", "deleted", "info"}
    POST /step     {"id", "action"}   -> {"observation", "reward", "score", "done", "info"}
    GET  /observation?id=        -> the last observation (a bare JSON string)
    POST /close    {"id"}        -> true / false
    GET  /instruction, GET /tasks?split=  (ours, so a client needs nothing else)

As in the original, application errors (unknown id, step before reset, bad task id) are HTTP 200 with
``{"error": "..."}``; malformed requests are 422 with FastAPI's ``{"detail": [...]}``.

Client: :class:`AgentGymHTTPEnv`, registered as ``"agentgym_http"``, speaks this protocol to our server
or to an original AgentGym server (``id`` dialect: BabyAI, TextCraft, SciWorld, ...; ``env_idx``
dialect: SearchQA, WebArena). Idempotent calls are retried with exponential back-off; ``/step`` is
retried only when the connection could not be made (a step that may have run is never sent twice).
"""


import itertools
import json
import secrets
import threading
import time
from typing import Any, Callable, Sequence

import requests
import urllib3

from environments.base import EnvError, Environment, StepResult, Task, check_split, make_env, register


class AgentGymHTTPError(EnvError):
    """Base class of the client's errors."""


class AgentGymServerError(AgentGymHTTPError):
    """The server answered with an ``{"error": ...}`` payload (the original's HTTP-200 errors) or a 5xx."""


class AgentGymProtocolError(AgentGymHTTPError):
    """The server's answer does not have the expected shape (wrong dialect, wrong URL, 404/422)."""


class AgentGymUnavailableError(AgentGymHTTPError):
    """The server could not be reached or did not answer in time, after all retries."""


# -- server -------------------------------------------------------------------------------------------


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
        return {
            "observation": result.observation,
            "reward": result.reward,
            "score": result.reward,
            "done": result.done,
            "info": _jsonable(result.info),
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

    def guarded(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except LookupError as error:
            return {"error": str(error.args[0]) if error.args else str(error)}
        except Exception as error:  # noqa: BLE001 - reported as the original does: HTTP 200 + "error"
            return {"error": f"{type(error).__name__}: {error}"}

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
        return guarded(server.create)

    @app.post("/reset")
    def reset(body: ResetBody) -> Any:
        return guarded(lambda: server.reset(body.id, body.data_idx))

    @app.post("/step")
    def step(body: StepBody) -> Any:
        return guarded(lambda: server.step(body.id, body.action))

    @app.get("/observation")
    def observation(id: int) -> Any:  # noqa: A002 - the protocol's name
        return guarded(lambda: server.observation(id))

    @app.post("/close")
    def close(body: CloseBody) -> Any:
        return guarded(lambda: server.close(body.id))

    @app.get("/instruction")
    def instruction() -> Any:
        return guarded(lambda: server.describe().instruction())

    @app.get("/tasks")
    def tasks(split: str) -> Any:
        return guarded(
            lambda: [
                {"task_id": t.task_id, "split": t.split, "subtask": t.subtask} for t in server.describe().tasks(split)
            ]
        )

    return app


# -- client -------------------------------------------------------------------------------------------


def _never_sent(error: Exception) -> bool:
    """Whether a request failed before reaching the server (refused or connect timeout), so is safe to resend."""
    if isinstance(error, requests.exceptions.ConnectTimeout):
        return True
    reason = getattr(error.args[0], "reason", None) if error.args else None
    return isinstance(reason, urllib3.exceptions.NewConnectionError)


_DIALECTS = {
    # dialect: (id key sent with every call, reset payload builder)
    "id": ("id", lambda task_id: {"data_idx": task_id}),
    "env_idx": ("env_idx", lambda task_id: {"id": task_id, "idx": task_id, "seed": 0}),
}


@register("agentgym_http")
class AgentGymHTTPEnv(Environment):
    """An environment played through an AgentGym env server (ours or an original one)."""

    name = "agentgym_http"

    def __init__(
        self,
        base_url: str,
        env_name: str = "",
        dialect: str = "id",
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        instruction: str | None = None,
        tasks_by_split: dict[str, Sequence[Task]] | None = None,
        reward_scale: float = 1.0,
        session: requests.Session | None = None,
    ) -> None:
        if dialect not in _DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}; use one of {sorted(_DIALECTS)}")
        if max_retries < 0 or timeout_s <= 0:
            raise ValueError("max_retries must be >= 0 and timeout_s > 0")
        self.base_url = base_url.rstrip("/")
        self.env_name = env_name
        self.dialect = dialect
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.reward_scale = reward_scale
        self._instruction = instruction
        self._tasks = dict(tasks_by_split or {})
        self._http = session or requests.Session()
        self._env_id: int | None = None
        self.last_observation = ""

    # -- transport ----------------------------------------------------------------------------------

    def _call(self, method: str, route: str, *, payload: Any = None, params: Any = None, idempotent: bool = True) -> Any:
        url = f"{self.base_url}/{route}"
        last_error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self._http.request(method, url, json=payload, params=params, timeout=self.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as error:
                last_error = error
                if idempotent or _never_sent(error):
                    continue
                break
            if response.status_code >= 500:
                last_error = AgentGymServerError(f"{method} {url} -> HTTP {response.status_code}: {response.text[:300]}")
                if not idempotent:
                    raise last_error
                continue
            if response.status_code != 200:
                raise AgentGymProtocolError(
                    f"{method} {url} -> HTTP {response.status_code}: {response.text[:300]}; "
                    "check base_url, the env server's version and dialect= ('id' or 'env_idx')"
                )
            try:
                body = response.json()
            except ValueError as error:
                raise AgentGymProtocolError(f"{method} {url} returned non-JSON: {response.text[:200]!r}") from error
            if isinstance(body, dict) and "error" in body:
                raise AgentGymServerError(f"{self.env_name or 'env'} server at {url}: {body['error']}")
            return body
        raise AgentGymUnavailableError(
            f"{method} {url} failed after {attempt + 1} attempt(s): {last_error}; is the env server running "
            f"(e.g. `python -m launch.serve_env --env={self.env_name or '<name>'} --port=...`)?"
        )

    def _expect(self, body: Any, keys: Sequence[str], route: str) -> dict[str, Any]:
        if not isinstance(body, dict) or any(k not in body for k in keys):
            raise AgentGymProtocolError(f"/{route} answered {str(body)[:200]!r}; expected keys {list(keys)}")
        return body

    # -- protocol -----------------------------------------------------------------------------------

    def _ensure_created(self) -> int:
        if self._env_id is None:
            body = self._call("POST", "create", payload={})
            id_key = _DIALECTS[self.dialect][0]
            env_id = body if isinstance(body, int) else self._expect(body, [id_key], "create")[id_key]
            self._env_id = int(env_id)
        return self._env_id

    def _with_id(self, payload: dict[str, Any]) -> dict[str, Any]:
        return {_DIALECTS[self.dialect][0]: self._ensure_created(), **payload}

    def instruction(self) -> str:
        if self._instruction is None:
            body = self._call("GET", "instruction")
            if not isinstance(body, str):
                raise AgentGymProtocolError(f"/instruction answered {str(body)[:200]!r}; pass instruction=")
            self._instruction = body
        return self._instruction

    def tasks(self, split: str) -> Sequence[Task]:
        check_split(split)
        if split not in self._tasks:
            try:
                rows = self._call("GET", "tasks", params={"split": split})
            except AgentGymProtocolError as error:
                raise AgentGymProtocolError(f"{error}; servers without /tasks need tasks_by_split=") from error
            self._tasks[split] = [Task(int(r["task_id"]), r["split"], r["subtask"]) for r in rows]
        return self._tasks[split]

    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        body = self._call("POST", "reset", payload=self._with_id(_DIALECTS[self.dialect][1](task_id)))
        if isinstance(body, str):  # SearchQA answers the prompt as a bare string
            observation, info = body, {}
        else:
            body = self._expect(body, ["observation"], "reset")
            observation, info = body["observation"], dict(body.get("info") or {})
        self.last_observation = observation
        return observation, info

    def step(self, action_text: str) -> StepResult:
        body = self._call("POST", "step", payload=self._with_id({"action": action_text}), idempotent=False)
        body = self._expect(body, ["observation"], "step")
        if "done" in body:
            done = bool(body["done"])
        else:  # WebArena's gymnasium-style answer
            done = bool(body.get("terminated")) or bool(body.get("truncated"))
        reward = body.get("score", body.get("reward", 0.0))
        self.last_observation = body["observation"]
        info = body.get("info") if isinstance(body.get("info"), dict) else {}
        return StepResult(body["observation"], float(reward or 0.0) * self.reward_scale, done, dict(info))

    def observation(self) -> str:
        """The server's current observation of this episode (``GET /observation``)."""
        id_key = _DIALECTS[self.dialect][0]
        body = self._call("GET", "observation", params={id_key: self._ensure_created()})
        return body if isinstance(body, str) else self._expect(body, ["observation"], "observation")["observation"]

    def close(self) -> None:
        if self._env_id is None:
            return
        env_id, self._env_id = self._env_id, None
        try:
            self._call("POST", "close", payload={_DIALECTS[self.dialect][0]: env_id})
        except AgentGymUnavailableError:
            pass  # the server is gone: nothing left to release
