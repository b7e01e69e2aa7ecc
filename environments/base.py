"""The environment protocol every agentgym-jax environment implements.

An environment is a plain-Python object (never imports JAX) that plays one episode at a time:

    env = make_env("babyai")
    observation, info = env.reset(task_id)
    result = env.step("Thought: ...\\n\\nAction:\\ngo to red ball 1")   # the agent's raw turn text

It owns its instruction prompt, its action parser, its invalid-action messages and its reward. Task ids
live in per-environment spaces split into ``train`` and ``test`` lists that never overlap.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Mapping, Sequence

SPLITS = ("train", "test")


class EnvError(Exception):
    """Base class for errors raised by environments (bad task id, bad configuration, ...)."""


class UnknownEnvironmentError(EnvError):
    """Raised by :func:`make_env` for a name that is not registered."""


class InvalidTaskError(EnvError):
    """Raised by ``reset`` for a task id outside the environment's task space."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of an environment's task space."""

    task_id: int
    split: str  # "train" or "test"
    subtask: str  # category used for per-subtask evaluation (e.g. "GoTo", "depth-2")


@dataclasses.dataclass
class StepResult:
    """What ``Environment.step`` returns."""

    observation: str
    reward: float  # the episode's current outcome score (not a per-step increment), in [0, 1]
    done: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # "success": the env's own pass verdict


class Environment(abc.ABC):
    """One episode at a time; ``reset`` starts a new one."""

    name: ClassVar[str]

    @abc.abstractmethod
    def instruction(self) -> str:
        """The task-independent instruction shown to the agent as the first user message."""

    @abc.abstractmethod
    def tasks(self, split: str) -> Sequence[Task]:
        """The task list of ``split`` ("train" or "test"), in a fixed, reproducible order."""

    @abc.abstractmethod
    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        """Starts the episode of ``task_id``; returns the first observation and an info dict."""

    @abc.abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Applies the agent's raw turn text (the environment parses the action out of it)."""

    def end_episode(self) -> None:
        """Called when the current episode is over and the instance waits for its next ``reset``."""

    def close(self) -> None:
        """Releases external resources (JVMs, browsers). Safe to call twice."""


_REGISTRY: dict[str, Callable[..., Environment]] = {}


def register(name: str) -> Callable[[Callable[..., Environment]], Callable[..., Environment]]:
    """Class decorator adding an environment factory to the registry under ``name``."""

    def decorator(factory: Callable[..., Environment]) -> Callable[..., Environment]:
        _REGISTRY[name] = factory
        return factory

    return decorator


def _import_builtin_environments() -> None:
    # Importing a package registers its environment. Missing optional packages only matter when used.
    import importlib

    for module in ("environments.babyai", "environments.textcraft", "environments.sciworld", "environments.searchqa",
                   "environments.agentgym_http", "environments.web"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:  # the package itself not written yet, or its dependency absent
            if error.name and error.name.startswith("environments."):
                continue
            raise


def registered_environments() -> list[str]:
    """Names accepted by :func:`make_env`."""
    _import_builtin_environments()
    return sorted(_REGISTRY)


def registered_factory(name: str) -> Callable[..., Environment]:
    """What :func:`make_env` calls for ``name`` (an environment class or factory)."""
    _import_builtin_environments()
    if name not in _REGISTRY:
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}; registered environments: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def make_env(name: str, **kwargs: Any) -> Environment:
    """Builds a registered environment by name, e.g. ``make_env("textcraft")``."""
    return registered_factory(name)(**kwargs)


def check_split(split: str) -> str:
    """Returns ``split`` or raises a clear error if it is not a known split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    return split


def task_index(tasks: Sequence[Task]) -> Mapping[int, Task]:
    """Maps task id to task, for lookups."""
    return {task.task_id: task for task in tasks}
