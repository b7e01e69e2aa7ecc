"""The AgentGym env-server protocol, client side: play any AgentGym env server as an environment.

:class:`AgentGymHTTPEnv`, registered as ``"agentgym_http"``, speaks the protocol (routes in
:mod:`environments.agentgym_server`) to our server or to an original AgentGym server through a server profile
(:mod:`environments.server_profiles`: action extraction, reward reading, dialect), over one server or a fleet
(:mod:`environments.fleet`). Idempotent calls are retried with exponential back-off; ``/create`` and ``/step``
only when the connection could not be made (a call that may have run is never sent twice).
"""


import time
from typing import Any, Callable, Sequence

import requests
import urllib3

from environments import server_profiles
from environments.fleet import FleetExhaustedError, parse_urls, shared_fleet
from environments.base import EnvError, Environment, StepResult, Task, check_split, make_env, register


class AgentGymHTTPError(EnvError):
    """Base class of the client's errors."""


class AgentGymServerError(AgentGymHTTPError):
    """The server answered with an ``{"error": ...}`` payload (the original's HTTP-200 errors) or a 5xx."""


class AgentGymProtocolError(AgentGymHTTPError):
    """The server's answer does not have the expected shape (wrong dialect, wrong URL, 404/422)."""


class AgentGymUnavailableError(AgentGymHTTPError):
    """The server could not be reached or did not answer in time, after all retries."""


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
    """An environment played through an AgentGym env server (ours or an original one).

    ``profile`` (:mod:`environments.server_profiles`) says how: ``agentgym-jax`` for our server (the default;
    whole turns, its own instruction, task lists and success), or ``babyai``, ``textcraft``, ``sciworld``,
    ``searchqa``, ``webarena`` for the original servers (the action extracted as their clients do, the
    reward read on their scale into [0, 1], instruction and task lists from our env with the same id space,
    built with ``local_env_kwargs``).
    The agent's raw turn stays in the trajectory; ``info["action_sent"]`` shows what went to the server.
    """

    name = "agentgym_http"

    def __init__(
        self,
        base_url: str | Sequence[str],
        profile: str = "agentgym-jax",
        env_name: str = "",
        dialect: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        instruction: str | None = None,
        tasks_by_split: dict[str, Sequence[Task]] | None = None,
        session: requests.Session | None = None,
        local_env_kwargs: dict[str, Any] | None = None,
        max_episodes_per_server: int = 0,
        retry_after_s: float = 30.0,
    ) -> None:
        self.profile = server_profiles.get_profile(profile)
        dialect = dialect or self.profile.dialect
        if dialect not in _DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}; use one of {sorted(_DIALECTS)}")
        if max_retries < 0 or timeout_s <= 0:
            raise ValueError("max_retries must be >= 0 and timeout_s > 0")
        self.urls = parse_urls(base_url)
        self.fleet = shared_fleet(self.urls, max_episodes_per_server, retry_after_s)
        self.base_url = self.urls[0]  # the server this instance's env lives on
        self._holding = False  # whether this instance holds an episode slot on base_url
        self.env_name = env_name or (self.profile.name if self.profile.local_env else "")
        self.dialect = dialect
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._instruction = instruction
        self._tasks = dict(tasks_by_split or {})
        self.local_env_kwargs = dict(local_env_kwargs or {})
        self._http = session or requests.Session()
        self._env_id: int | None = None
        self._outcome = server_profiles.Outcome(0.0, False, False)  # the episode so far, as the profile read it
        self.last_observation = ""

    # -- transport ----------------------------------------------------------------------------------

    def _call(self, method: str, route: str, *, payload: Any = None, params: Any = None, idempotent: bool = True,
              server: str | None = None) -> Any:
        """One request to ``server`` (default: this instance's); idempotent calls are retried, the others only
        when they never reached the server."""
        url = f"{server or self.base_url}/{route}"
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
                last_error = AgentGymServerError(
                    f"{method} {url} -> HTTP {response.status_code}: {response.text[:300]}")
                if not idempotent:
                    raise last_error
                continue
            if response.status_code == 404 and route in ("instruction", "tasks"):
                raise AgentGymProtocolError(
                    f"{method} {url} -> HTTP 404: this server does not serve /{route} (an original AgentGym server?); "
                    f"use its profile (profile='babyai', 'textcraft', ...) or pass "
                    f"{'instruction=' if route == 'instruction' else 'tasks_by_split='}"
                )
            if response.status_code != 200:
                raise AgentGymProtocolError(
                    f"{method} {url} -> HTTP {response.status_code}: {response.text[:300]}; "
                    f"check base_url, the server's version and the profile ({self.profile.name!r})"
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
            # Never resent after it may have reached the server: a retried /create can leak a server-side env.
            body = self._call("POST", "create", payload={}, idempotent=False)
            id_key = _DIALECTS[self.dialect][0]
            env_id = body if isinstance(body, int) else self._expect(body, [id_key], "create")[id_key]
            self._env_id = int(env_id)
        return self._env_id

    def _with_id(self, payload: dict[str, Any]) -> dict[str, Any]:
        return {_DIALECTS[self.dialect][0]: self._ensure_created(), **payload}

    def _local_env(self) -> Environment | None:
        """Our in-process twin of an original server: the source of its instruction and task lists."""
        return make_env(self.profile.local_env, **self.local_env_kwargs) if self.profile.local_env else None

    def instruction(self) -> str:
        if self._instruction is None:
            local = self._local_env()
            if local is not None:
                self._instruction = local.instruction()
                local.close()
            else:
                body = self._on_any_server(lambda url: self._call("GET", "instruction", server=url))
                if not isinstance(body, str):
                    raise AgentGymProtocolError(f"/instruction answered {str(body)[:200]!r}; pass instruction=")
                self._instruction = body
        return self._instruction

    def tasks(self, split: str) -> Sequence[Task]:
        check_split(split)
        if split not in self._tasks:
            local = self._local_env()
            if local is not None:
                self._tasks[split] = list(local.tasks(split))
                local.close()
            else:
                rows = self._on_any_server(lambda url: self._call("GET", "tasks", params={"split": split}, server=url))
                self._tasks[split] = [Task(int(r["task_id"]), r["split"], r["subtask"]) for r in rows]
        return self._tasks[split]

    def _on_any_server(self, call: Callable[[str], Any]) -> Any:
        """An idempotent query answered by the first server that answers (for instruction and task lists); the
        instance stays bound to its own server."""
        for url in [u for u in self.urls if self.fleet.available(u)] or self.urls:
            try:
                return call(url)
            except AgentGymUnavailableError:
                self.fleet.mark_down(url)
                last = url
        raise AgentGymUnavailableError(f"none of the env servers {self.urls} answered (last tried {last})")

    def _release(self) -> None:
        if self._holding:
            self.fleet.release(self.base_url)
            self._holding = False

    def _move_to(self, url: str) -> None:
        """Binds this instance to ``url``, closing its env on the previous server (best effort)."""
        if url == self.base_url:
            return
        if self._env_id is not None and self.fleet.available(self.base_url):
            try:
                self._http.post(f"{self.base_url}/close", json={_DIALECTS[self.dialect][0]: self._env_id}, timeout=5)
            except requests.RequestException:
                pass
        self.base_url, self._env_id = url, None

    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        """Starts ``task_id`` on the least-loaded answering server; a server that does not answer is taken out of
        rotation and the next one is tried (nothing of the episode has happened yet)."""
        tried: list[str] = []
        last_error: AgentGymUnavailableError | None = None
        while True:
            self._release()
            try:
                url = self.fleet.acquire(preferred=self.base_url, exclude=tried)
            except FleetExhaustedError as error:
                cause = f"; last error: {last_error}" if last_error else ""
                raise AgentGymUnavailableError(f"{error}{cause}") from None
            self._holding = True
            self._move_to(url)
            try:
                body = self._call("POST", "reset", payload=self._with_id(_DIALECTS[self.dialect][1](task_id)))
                break
            except AgentGymUnavailableError as error:
                self.fleet.mark_down(url)
                self._env_id, last_error = None, error
                tried.append(url)
        if isinstance(body, str):  # SearchQA answers the prompt as a bare string
            observation, info = body, {}
        else:
            body = self._expect(body, ["observation"], "reset")
            observation, info = body["observation"], dict(body.get("info") or {})
        self.last_observation = observation
        self._outcome = server_profiles.Outcome(0.0, False, False)
        info["env_server"] = self.base_url
        return observation, info

    def end_episode(self) -> None:
        self._release()

    def step(self, action_text: str) -> StepResult:
        extraction = self.profile.extract(action_text)
        if extraction.action is None:  # what the original client does: answer locally, send nothing
            info = {"action_sent": None, "success": self._outcome.success, "invalid_format": True}
            return StepResult(extraction.local_observation, self._outcome.score, self._outcome.done, info)
        try:
            body = self._call("POST", "step", payload=self._with_id({"action": extraction.action}), idempotent=False)
        except AgentGymUnavailableError as error:
            url = self.base_url
            self.fleet.mark_down(url)
            self._release()
            self._env_id = None
            raise AgentGymUnavailableError(
                f"env server {url} stopped answering during this episode ({error}); the episode is lost and the "
                f"server is out of rotation for {self.fleet.retry_after_s:g} s") from None
        body = self._expect(body, ["observation"], "step")
        outcome = self._outcome = self.profile.outcome(body, self._outcome.score)
        self.last_observation = body["observation"]
        info = dict(body.get("info")) if isinstance(body.get("info"), dict) else {}
        info.update(action_sent=extraction.action, success=outcome.success, env_server=self.base_url)
        for key in ("reward", "score"):
            if key in body:
                info[f"server_{key}"] = body[key]
        return StepResult(body["observation"], outcome.score, outcome.done, info)

    def observation(self) -> str:
        """The server's current observation of this episode (``GET /observation``)."""
        id_key = _DIALECTS[self.dialect][0]
        body = self._call("GET", "observation", params={id_key: self._ensure_created()})
        return body if isinstance(body, str) else self._expect(body, ["observation"], "observation")["observation"]

    def close(self) -> None:
        self._release()
        if self._env_id is None or not self.fleet.available(self.base_url):
            self._env_id = None
            return
        env_id, self._env_id = self._env_id, None
        try:
            self._call("POST", "close", payload={_DIALECTS[self.dialect][0]: env_id})
        except AgentGymUnavailableError:
            pass  # the server is gone: nothing left to release
