"""What each kind of AgentGym env server expects and answers: server profiles for the HTTP client.

The original AgentGym servers take a bare action (their clients extract it from the agent's turn), report
rewards on their own scales, and serve neither an instruction nor task lists. A profile holds, per server
kind, what the client needs to play it as the original clients do:

- ``extract``: agent turn -> :class:`Extraction` (the action to send, or a local answer when the original client
  would not call the server at all);
- ``outcome``: the server's step answer + the episode's previous outcome -> (outcome in [0, 1], done, success);
- ``dialect``: ``id`` (BabyAI, TextCraft, SciWorld, ours) or ``env_idx`` (SearchQA, WebArena);
- ``local_env``: our in-process environment with the same task-id space, which supplies the instruction and the
  train/test task lists the original server does not serve (None: pass ``instruction=``/``tasks_by_split=``).

Profiles are registered by name (:func:`register_profile`); ``agentgym-jax`` is our own server, which parses
whole turns itself, serves ``/instruction`` and ``/tasks`` and reports success in ``info``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping

from environments import react


@dataclasses.dataclass(frozen=True)
class Extraction:
    """An agent turn as the server should see it: ``action`` to send, or ``local_observation`` instead."""

    action: str | None
    local_observation: str = ""  # what the agent is told when nothing is sent (the original client's message)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The episode's state after a step, as this project defines it."""

    score: float  # the episode's current outcome in [0, 1]
    done: bool
    success: bool


Extractor = Callable[[str], Extraction]
OutcomeReader = Callable[[Mapping[str, Any], float], Outcome]


@dataclasses.dataclass(frozen=True)
class ServerProfile:
    """How to play one kind of env server (see the module docstring)."""

    name: str
    extract: Extractor
    outcome: OutcomeReader
    dialect: str = "id"
    local_env: str | None = None
    doc: str = ""


_PROFILES: dict[str, ServerProfile] = {}


def register_profile(profile: ServerProfile) -> ServerProfile:
    """Adds ``profile`` to the registry (replacing one of the same name)."""
    _PROFILES[profile.name] = profile
    return profile


def get_profile(name: str) -> ServerProfile:
    """The profile called ``name``, with the list of known ones when there is none."""
    if name not in _PROFILES:
        raise ValueError(f"unknown env-server profile {name!r}; known profiles: {', '.join(sorted(_PROFILES))}")
    return _PROFILES[name]


def profile_names() -> list[str]:
    return sorted(_PROFILES)


# -- action extraction -----------------------------------------------------------------------------------------

ONE_ACTION_ONLY = "Error: Only one 'Action' is allowed per response. Please adjust your response."
NO_ACTION = ("Error: no action found. Your response should use the format:\nThought:\n<your reasoning>\n\n"
             "Action:\n<one action>")
_REACT_LINE = re.compile(r"Action:\s*(.*?)(?=\n|$)")
_BACKTICKS = re.compile(r"```((?:.|\n)*?)```")
_SEARCH_TAGS = re.compile(r"<(search|answer)>(.*?)</\1>", flags=re.DOTALL)
WEBARENA_NO_ACTION = ("Cannot parse action from response. Your action should be inside triple backticks (```). "
                      "Please adjust accordingly.")


def whole_turn(turn: str) -> Extraction:
    """Our own server parses the turn itself: send it unchanged."""
    return Extraction(turn)


def react_one_line(turn: str) -> Extraction:
    """TextCraft/BabyAI clients: the line after the only ``Action:``, cleaned to ``[A-Za-z0-9, ]``."""
    found = _REACT_LINE.findall(turn)
    if len(found) > 1:
        return Extraction(None, ONE_ACTION_ONLY)
    if not found:
        return Extraction(None, NO_ACTION)
    return Extraction(react.sanitize_command(found[0]))


def react_free_text(turn: str) -> Extraction:
    """SciWorld client: everything after the last ``Action:``, stripped (may span lines)."""
    after = react.text_after_last_action(turn)
    return Extraction(None, NO_ACTION) if after is None else Extraction(after)


def search_tags(turn: str) -> Extraction:
    """SearchQA: the first ``<search>``/``<answer>`` block; the server answers a turn without one itself."""
    found = _SEARCH_TAGS.search(turn)
    return Extraction(found.group(0) if found else turn)


def webarena_backticks(turn: str) -> Extraction:
    """WebArena: the action inside the first triple backticks; without them nothing is sent."""
    found = _BACKTICKS.search(turn)
    return Extraction(found.group(1).strip()) if found else Extraction(None, WEBARENA_NO_ACTION)


# -- outcome readers ------------------------------------------------------------------------------------------


def _number(body: Mapping[str, Any], key: str) -> float:
    value = body.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _clip(value: float) -> float:
    return min(1.0, max(0.0, value))


def ours(body: Mapping[str, Any], previous: float) -> Outcome:
    """Our server: ``reward`` is already the outcome in [0, 1]; ``info["success"]`` is the env's own verdict."""
    info = body.get("info") if isinstance(body.get("info"), Mapping) else {}
    score = _clip(_number(body, "reward"))
    return Outcome(score, bool(body.get("done")), bool(info.get("success", False)))


def babyai_first_success(body: Mapping[str, Any], previous: float) -> Outcome:
    """Original BabyAI: the step's ``reward`` (minigrid's 1 - 0.9 * steps / max_steps when the goal is reached).

    The server's ``score`` is a running sum, and a success worth <= 0.5 leaves ``done`` false, so it could be
    collected again; the first positive reward is the outcome and ends the episode.
    """
    reward = _number(body, "reward")
    if previous > 0:
        return Outcome(previous, True, True)
    if reward > 0:
        return Outcome(_clip(reward), True, True)
    return Outcome(0.0, bool(body.get("done")), False)


def binary_reward(body: Mapping[str, Any], previous: float) -> Outcome:
    """TextCraft / SearchQA: ``reward`` 1 on success (with done), else 0."""
    score = _clip(max(previous, _number(body, "reward")))
    return Outcome(score, bool(body.get("done")), score >= 1.0)


def sciworld_score(body: Mapping[str, Any], previous: float) -> Outcome:
    """Original SciWorld: ``score`` is ScienceWorld's 0-100 task score (-100 on failure); success is 100."""
    raw = _number(body, "score") if "score" in body else _number(body, "reward")
    return Outcome(_clip(raw / 100.0), bool(body.get("done")), raw >= 100.0)


def webarena_terminal(body: Mapping[str, Any], previous: float) -> Outcome:
    """WebArena: gymnasium-style ``terminated``/``truncated``; the 0/1 reward counts only when terminated."""
    terminated, truncated = bool(body.get("terminated")), bool(body.get("truncated"))
    score = _clip(_number(body, "reward")) if terminated else 0.0
    return Outcome(score, terminated or truncated, score >= 1.0)


for _profile in (
    ServerProfile("agentgym-jax", whole_turn, ours, doc="this project's server (launch.serve_env)"),
    ServerProfile("babyai", react_one_line, babyai_first_success, local_env="babyai",
                  doc="original AgentGym BabyAI server (agentenv-babyai)"),
    ServerProfile("textcraft", react_one_line, binary_reward, local_env="textcraft",
                  doc="original AgentGym TextCraft server (agentenv-textcraft)"),
    ServerProfile("sciworld", react_free_text, sciworld_score, local_env="sciworld",
                  doc="original AgentGym SciWorld server (agentenv-sciworld)"),
    ServerProfile("searchqa", search_tags, binary_reward, dialect="env_idx",
                  doc="original AgentGym-RL SearchQA server (agentenv-searchqa)"),
    ServerProfile("webarena", webarena_backticks, webarena_terminal, dialect="env_idx",
                  doc="original AgentGym WebArena server (agentenv-webarena)"),
):
    register_profile(_profile)
