"""Pointing a run at an env server from the command line: ``--config.env.remote=URL``.

    python -m launch.train --config=configs/babyai_grpo.py --config.env.remote=http://127.0.0.1:36001
    python -m launch.eval  --config=configs/textcraft_grpo.py --config.env.remote=http://10.0.0.7:36001 \\
        --config.env.remote_profile=textcraft

Several servers (a fleet, :mod:`environments.fleet`) are comma-separated:
``--config.env.remote=http://10.0.0.7:36001,http://10.0.0.8:36001``; ``env.kwargs.max_episodes_per_server`` and
``env.kwargs.retry_after_s`` tune it.

With ``env.remote`` set, the run plays ``agentgym_http`` against that server instead of building ``env.name``
in-process. The profile (:mod:`environments.server_profiles`) is ``env.remote_profile``, or found out: a server
that serves ``/tasks`` is ours (``agentgym-jax``); any other is taken to be the original AgentGym server of
``env.name`` (``babyai``, ``textcraft``, ``sciworld``, ...). ``env.kwargs`` then set client options (e.g.
``timeout_s``) and what our local twin of an original server shows (instruction, task lists).
"""

from __future__ import annotations

from typing import Any, Mapping

import logging

import requests

from environments import server_profiles
from environments.fleet import parse_urls

log = logging.getLogger(__name__)
CLIENT_OPTIONS = ("timeout_s", "max_retries", "backoff_s", "instruction", "tasks_by_split", "dialect",
                  "max_episodes_per_server", "retry_after_s")


class RemoteConfigError(ValueError):
    """``env.remote`` settings that cannot work, with what to change."""


def serves_task_lists(base_url: str, timeout_s: float = 10.0) -> bool:
    """Whether the server at ``base_url`` is one of ours (it answers ``GET /tasks``); raises if unreachable."""
    url = base_url.rstrip("/")
    try:
        response = requests.get(f"{url}/tasks", params={"split": "test"}, timeout=timeout_s)
    except requests.RequestException as error:
        raise RemoteConfigError(f"env.remote={base_url!r} cannot be reached ({type(error).__name__}); start the "
                                "server first or fix the URL") from None
    return response.status_code == 200 and isinstance(response.json(), list)


def _first_answer(urls: list[str]) -> bool:
    """Whether the first server that answers is ours; raises when none answers."""
    errors = []
    for url in urls:
        try:
            return serves_task_lists(url)
        except RemoteConfigError as error:
            errors.append(str(error))
    raise RemoteConfigError(errors[0] if len(errors) == 1 else f"no server of env.remote answers: {errors}")


def remote_env_spec(remote: str, env_name: str, profile: str = "",
                    kwargs: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """The ``(name, kwargs)`` to build for ``env.remote``: ``agentgym_http`` with the resolved profile.

    ``kwargs`` (the config's ``env.kwargs``) are split: client options go to the client; the rest configure the
    local twin that supplies an original server's instruction and task lists (e.g. BabyAI's
    ``instruction_style``, ``levels``). How actions are judged is the server's business, whatever they say.
    """
    kwargs = dict(kwargs or {})
    urls = parse_urls(remote)
    bad = [url for url in urls if not url.startswith(("http://", "https://"))]
    if bad:
        raise RemoteConfigError(f"env.remote: {bad} is not an http(s) URL; e.g. http://127.0.0.1:36001 (several: "
                                "comma-separated)")
    if not profile:
        profile = "agentgym-jax" if _first_answer(urls) else env_name
    try:
        chosen = server_profiles.get_profile(profile)
    except ValueError as error:
        raise RemoteConfigError(f"{error}; set --config.env.remote_profile") from None
    client = {k: v for k, v in kwargs.items() if k in CLIENT_OPTIONS}
    twin = {k: v for k, v in kwargs.items() if k not in CLIENT_OPTIONS}
    if twin and chosen.local_env is None:
        log.warning("env.kwargs %s are not used: the server at %s has its own settings", sorted(twin), remote)
        twin = {}
    elif twin:
        log.warning("with env.remote, env.kwargs %s shape only the instruction and task lists; the server at %s "
                    "judges actions with its own settings", sorted(twin), remote)
    return "agentgym_http", dict(client, base_url=",".join(urls), profile=profile, env_name=env_name,
                                 local_env_kwargs=twin)
