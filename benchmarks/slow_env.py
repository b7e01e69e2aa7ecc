"""BabyAI whose every step also waits ``step_seconds`` (registered as "babyai_slow"): the time a web page load or
a remote environment server adds to a step, for measuring what overlapping environment steps with sampling saves
(``benchmarks/rollout.py --part=async_env``). Everything else is BabyAI's."""

from __future__ import annotations

import time
from typing import Any

from environments.babyai.env import BabyAIEnvironment
from environments.base import StepResult, register


@register("babyai_slow")
class SlowBabyAIEnvironment(BabyAIEnvironment):
    name = "babyai_slow"

    def __init__(self, step_seconds: float = 0.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.step_seconds = step_seconds

    def step(self, action_text: str) -> StepResult:
        time.sleep(self.step_seconds)
        return super().step(action_text)
