"""BabyAI that ends an episode at the first action it does not understand (registered as "babyai_strict"), as
environments with strict action parsers do: episodes then end at turns the policy's own samples decide, not all
at the horizon. The workload with varied episode lengths for comparing the rollout loops
(``benchmarks/rollout.py --part=loops``). Everything else is BabyAI's."""

from __future__ import annotations

import dataclasses

from environments.babyai.env import BabyAIEnvironment
from environments.base import StepResult, register


@register("babyai_strict")
class StrictBabyAIEnvironment(BabyAIEnvironment):
    name = "babyai_strict"

    def step(self, action_text: str) -> StepResult:
        result = super().step(action_text)
        if result.info.get("action_valid") is False:
            self._done = True
            return dataclasses.replace(result, done=True)
        return result
