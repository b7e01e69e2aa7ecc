"""ScalingInter-RL horizon schedules: the cap on agent turns per episode as a function of the training step.

Steps are 1-based (the first training step is step 1). Every schedule is a pure function of the step, so a resumed
run gets exactly the horizon the uninterrupted run would have had (the original's scheduler is off by one there).

* ``fixed``:    ``turns`` at every step.
* ``stepwise``: ``rounds = [h0, h1, ...]``; stage i starts at step ``1 + i * steps_per_stage`` (the original's
  ``scaling_inter_stepwise``: steps 1..N use h0, N+1..2N use h1, ...), or at the explicit 1-based
  ``stage_starts = [1, s1, s2, ...]`` when given.
* ``linear``:   from ``start`` at step 1 growing by ``increment`` every ``steps_per_stage`` steps up to ``end``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from agentgym_jax.errors import ConfigError

SCHEDULE_TYPES = ("fixed", "stepwise", "linear")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"horizon.{name} must be a positive integer, got {value!r}")
    return value


def validate_schedule(config: Mapping[str, Any]) -> None:
    """Raises a ``ConfigError`` naming the key for a schedule that cannot work."""
    kind = config.get("type")
    if kind not in SCHEDULE_TYPES:
        raise ConfigError(f"horizon.type must be one of {SCHEDULE_TYPES}, got {kind!r}")
    if kind == "fixed":
        _positive_int("turns", config.get("turns"))
    elif kind == "stepwise":
        rounds: Sequence[Any] = config.get("rounds") or ()
        if isinstance(rounds, int) or not rounds:
            raise ConfigError("horizon.rounds must be a non-empty list of horizons for a stepwise schedule")
        for value in rounds:
            _positive_int("rounds[i]", value)
        starts = config.get("stage_starts")
        if starts:
            if len(starts) != len(rounds) or starts[0] != 1 or list(starts) != sorted(set(starts)):
                raise ConfigError(
                    "horizon.stage_starts must have one strictly increasing 1-based start per horizon, starting at 1"
                )
        else:
            _positive_int("steps_per_stage", config.get("steps_per_stage"))
    else:
        start, end = _positive_int("start", config.get("start")), _positive_int("end", config.get("end"))
        _positive_int("increment", config.get("increment"))
        _positive_int("steps_per_stage", config.get("steps_per_stage"))
        if end < start:
            raise ConfigError(f"horizon.end ({end}) must be >= horizon.start ({start})")


def horizon_at(config: Mapping[str, Any], step: int) -> int:
    """The maximum number of agent turns at 1-based training ``step``."""
    if step < 1:
        raise ConfigError(f"training steps are 1-based, got step {step}")
    validate_schedule(config)
    kind = config["type"]
    if kind == "fixed":
        return int(config["turns"])
    if kind == "stepwise":
        rounds = list(config["rounds"])
        starts = config.get("stage_starts")
        if starts:
            stage = max(i for i, s in enumerate(starts) if s <= step)
        else:
            stage = min((step - 1) // int(config["steps_per_stage"]), len(rounds) - 1)
        return int(rounds[stage])
    grown = int(config["start"]) + ((step - 1) // int(config["steps_per_stage"])) * int(config["increment"])
    return min(grown, int(config["end"]))


def max_horizon(config: Mapping[str, Any]) -> int:
    """The largest horizon the schedule ever reaches (sizes token budgets and evaluation)."""
    validate_schedule(config)
    kind = config["type"]
    if kind == "fixed":
        return int(config["turns"])
    if kind == "stepwise":
        return max(int(r) for r in config["rounds"])
    return int(config["end"])
