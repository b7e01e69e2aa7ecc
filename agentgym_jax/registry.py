"""Named registries for the parts users extend (advantage estimators, policy losses), with declared options.

A registered function declares its options as keyword parameters with defaults. At run time each option is
resolved, in order, from the run's explicit options for that part (``algo.estimator_options`` /
``algo.loss_options``), from the learner setting of the same name (e.g. ``gamma``, ``clip_low``), else from the
function's own default, so a new algorithm needs no edit anywhere else::

    @register_estimator("my_estimator", requires=("scores", "loss_mask", "group_ids"), min_group_size=2)
    def my_estimator(*, scores, loss_mask, group_ids, temperature_of_baseline: float = 1.0): ...
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Generic, Mapping, TypeVar

from agentgym_jax.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered function with what it needs: batch fields, group size, a critic."""

    name: str
    fn: Callable[..., Any]
    requires: tuple[str, ...] = ()
    min_group_size: int = 1
    uses_critic: bool = False
    inputs: tuple[str, ...] = ()  # parameter names that are data (the registry's inputs), never options

    def options(self) -> dict[str, Any]:
        """Keyword options and their defaults (parameters with a default that are not data inputs)."""
        data = set(self.requires) | set(self.inputs)
        return {name: p.default for name, p in inspect.signature(self.fn).parameters.items()
                if p.default is not inspect.Parameter.empty and name not in data}

    def resolve_options(self, explicit: Mapping[str, Any], settings: Any, kind: str) -> dict[str, Any]:
        """The option values for a run: ``explicit`` first, then ``settings.<name>``, then the default."""
        declared = self.options()
        unknown = sorted(set(explicit) - set(declared))
        if unknown:
            raise ConfigError(f"{kind} {self.name!r} has no option(s) {unknown}; its options are "
                              f"{sorted(declared) or 'none'}")
        return {name: explicit[name] if name in explicit else getattr(settings, name, default)
                for name, default in declared.items()}


class Registry(Generic[F]):
    """Name -> :class:`Entry`; unknown names are errors that list the registered ones."""

    def __init__(self, kind: str, inputs: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.inputs = inputs
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, *, requires: tuple[str, ...] = (), min_group_size: int = 1,
                 uses_critic: bool = False) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` (a second registration of a name replaces the first)."""

        def decorator(fn: F) -> F:
            self._entries[name] = Entry(name, fn, tuple(requires), min_group_size, uses_critic, self.inputs)
            return fn

        return decorator

    def get(self, name: str) -> Entry:
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._entries))} "
                              "(a module that registers another can be loaded with algo.import_modules)")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: str) -> bool:
        return name in self._entries
