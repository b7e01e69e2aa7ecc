"""A trivially learnable multi-turn environment for trainer tests (registered as "letters").

Each episode has ``turns`` agent turns (with ``stop_on_hit``, it ends at its first scoring turn). A turn scores when the agent's reply starts (after spaces) with one of
the letters a-m, any case; the episode's reward after each turn is the share of turns scored so far, and it ends
after the last turn. A random policy scores around a third; a policy that learns scores 1. ``step_seconds`` makes
each step take that long (a slow environment: a page load, a remote server).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from environments.base import Environment, StepResult, Task, check_split, register

GOOD = set("abcdefghijklmABCDEFGHIJKLM")


@register("letters")
class LettersEnvironment(Environment):
    name = "letters"

    def __init__(self, turns: int = 2, num_train: int = 64, num_test: int = 16, stop_on_hit: bool = False,
                 step_seconds: float = 0.0):
        self.turns, self.num_train, self.num_test, self.step_seconds = turns, num_train, num_test, step_seconds
        self.stop_on_hit = stop_on_hit  # end at the first scoring turn: episodes of varied length
        self._turn, self._hits = 0, 0

    def instruction(self) -> str:
        return "Reply with one word."

    def tasks(self, split: str) -> Sequence[Task]:
        check_split(split)
        ids = range(self.num_test) if split == "test" else range(self.num_test, self.num_test + self.num_train)
        return [Task(task_id=i, split=split, subtask=f"group-{i % 2}") for i in ids]

    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        self._turn, self._hits = 0, 0
        return f"Task {task_id}: say a word.", {"task_id": task_id}

    def step(self, action_text: str) -> StepResult:
        time.sleep(self.step_seconds)
        self._turn += 1
        stripped = action_text.lstrip()
        hit = bool(stripped) and stripped[0] in GOOD
        self._hits += hit
        done = self._turn >= self.turns or (self.stop_on_hit and hit)
        score = self._hits / self.turns
        return StepResult(f"Turn {self._turn} noted. Another word.", score, done,
                          {"success": done and self._hits == self.turns})
