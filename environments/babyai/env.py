"""The BabyAI environment: minigrid levels played through text observations and macro actions."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from typing import Any, Sequence

import gymnasium
import minigrid  # noqa: F401  (importing minigrid registers the BabyAI levels with gymnasium)

from environments.base import EnvError, Environment, InvalidTaskError, StepResult, Task, register
from environments.babyai import levels as levels_lib
from environments.babyai.parsing import check_matching_mode, extract_action, match_action
from environments.babyai.planner import CHECK_ACTIONS, FORWARD, MacroTable, macro_actions
from environments.babyai.prompt import INSTRUCTIONS
from environments.babyai.view import describe, observe

NOT_RECOGNIZED = "The action is not recognized. Please check valid actions."
NO_ACTION = "No change in state."
COMPLETED = "The task is completed."
INFO_ACTION_CHARS = 200  # an unmatched action is kept in info only up to this length


class EpisodeStateError(EnvError):
    """Raised for ``step`` before ``reset`` or after the episode has ended."""


def format_available(names: Sequence[str]) -> str:
    """The original's action-list line: ``Available actions: ["turn left", ...]``."""
    return "Available actions: " + json.dumps(list(names))


@register("babyai")
class BabyAIEnvironment(Environment):
    """BabyAI with the original's task ids (level = id % 40, seed = id // 40) and macro actions.

    Args:
        action_matching: ``"exact"`` (the action must be one of the listed strings) or ``"closest"``
            (lenient matching, see :mod:`environments.babyai.parsing`).
        num_test_seeds: seeds ``[0, num_test_seeds)`` form the test split (40 tasks per seed).
        num_train_seeds: the following seeds form the train split.
        instruction_style: ``"full"``, ``"compact"`` (a quarter of the tokens, one worked example) or ``"brief"``
            (compact without the example).
        levels: gym ids of the levels the task lists keep (empty: all 40), e.g. a task family for a demo.
    """

    name = "babyai"

    def __init__(self, action_matching: str = "exact", num_test_seeds: int = 3, num_train_seeds: int = 100,
                 instruction_style: str = "full", levels: Sequence[str] = ()):
        self.action_matching = check_matching_mode(action_matching)
        if instruction_style not in INSTRUCTIONS:
            raise ValueError(f"instruction_style must be one of {sorted(INSTRUCTIONS)}, got {instruction_style!r}")
        self._instruction = INSTRUCTIONS[instruction_style]
        self.splits = levels_lib.SplitConfig(num_test_seeds=num_test_seeds, num_train_seeds=num_train_seeds)
        known = {level.gym_id for level in levels_lib.LEVELS}
        unknown = [name for name in levels if name not in known]
        if unknown:
            raise ValueError(f"unknown BabyAI level(s) {unknown}; use gym ids from environments.babyai.levels.LEVELS, "
                             "e.g. 'BabyAI-GoToLocalS8N7-v0'")
        self.levels = tuple(levels)  # task lists keep only these levels (empty: all 40)
        self._envs: dict[str, Any] = {}  # gymnasium env per level, built on first use
        self._env: Any = None  # the unwrapped minigrid env of the current episode
        self._table: MacroTable | None = None
        self._info: dict[str, Any] = {}
        self._done = True
        self._score = 0.0

    # -- protocol ---------------------------------------------------------------------------------
    def instruction(self) -> str:
        return self._instruction

    def tasks(self, split: str) -> Sequence[Task]:
        tasks = self.splits.tasks(split)
        if not self.levels:
            return tasks
        return [t for t in tasks if levels_lib.level_and_seed(t.task_id)[0].gym_id in self.levels]

    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        level, seed = self._check_task(task_id)
        gym_env = self._envs.get(level.gym_id)
        if gym_env is None:
            gym_env = self._envs[level.gym_id] = gymnasium.make(level.gym_id)
        # Level generation prints "Sampling rejected: ..." while it rejects layouts; keep stdout clean.
        with contextlib.redirect_stdout(io.StringIO()):
            gym_env.reset(seed=seed)
        self._env = gym_env.unwrapped
        self._done = False
        self._score = 0.0
        self._info = {
            "task_id": task_id,
            "level": level.gym_id,
            "seed": seed,
            "subtask": level.subtask,
            "mission": self._env.mission,
            "max_steps": int(self._env.max_steps),
            "steps": 0,
            "turns": 0,
            "success": False,
            "action": None,
            "action_valid": None,
        }
        text = self._describe_and_plan()
        self._info["state_key"] = self._state_key()
        return f"Your goal: {self._env.mission}\n{text}\n{format_available(self._table.names())}", dict(self._info)

    def step(self, action_text: str) -> StepResult:
        if self._env is None:
            raise EpisodeStateError("step() called before reset(); call reset(task_id) first")
        if self._done:
            raise EpisodeStateError(
                f"the episode of task {self._info['task_id']} has finished; call reset(task_id) to start another"
            )
        parsed = extract_action(action_text)
        assert self._table is not None
        names = self._table.names()
        chosen = match_action(parsed, names, self.action_matching)
        self._info["turns"] += 1
        self._info["action"] = chosen if chosen is not None else parsed[:INFO_ACTION_CHARS]
        self._info["action_valid"] = chosen is not None
        if chosen is None:
            if not parsed:
                message = NO_ACTION
            else:
                message = self._table.reasons.get(parsed, NOT_RECOGNIZED)
            return self._result(f"{message}\n{format_available(names)}")
        if chosen == CHECK_ACTIONS:
            listing = "You can take the following actions: " + ", ".join(names)
            return self._result(f"{listing}\n{format_available(names)}")

        status = self._execute(self._table.actions[chosen])
        text = self._describe_and_plan()
        if status == "success":
            return self._result(f"{text} {COMPLETED}")
        if status == "failure":
            return self._result(f"{text} You did something the goal rules out, so the task has failed.")
        if status == "truncated":
            steps = self._info["steps"]
            return self._result(f"{text} You have used all {steps} steps of this task, so the task has failed.")
        return self._result(f"{text}\n{format_available(self._table.names())}")

    def close(self) -> None:
        for gym_env in self._envs.values():
            gym_env.close()
        self._envs.clear()
        self._env = None
        self._table = None
        self._done = True

    # -- internals --------------------------------------------------------------------------------
    def _check_task(self, task_id: int) -> tuple[levels_lib.Level, int]:
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise InvalidTaskError(f"BabyAI task ids are ints, got {task_id!r} ({type(task_id).__name__})")
        if task_id < 0 or task_id // levels_lib.NUM_LEVELS > levels_lib.MAX_SEED:
            raise InvalidTaskError(
                f"BabyAI task id {task_id} is outside [0, {(levels_lib.MAX_SEED + 1) * levels_lib.NUM_LEVELS}); "
                "ids are level + 40 * seed"
            )
        return levels_lib.level_and_seed(task_id)

    def _describe_and_plan(self) -> str:
        view = observe(self._env)
        self._table = macro_actions(view)
        return describe(view)

    def _execute(self, primitives: Sequence[int]) -> str:
        """Runs primitive actions until done; returns success/failure/truncated/ongoing."""
        env = self._env
        for action in primitives:
            if action == FORWARD:
                cell = env.grid.get(*env.front_pos)
                if cell is not None and not cell.can_overlap():
                    break  # the rest of the macro would walk into something not seen when planning
            _, reward, terminated, truncated, _ = env.step(action)
            self._info["steps"] = int(env.step_count)
            if terminated:
                self._done = True
                if reward > 0:
                    self._score = float(reward)
                    self._info["success"] = True
                    return "success"
                return "failure"
            if truncated:
                self._done = True
                return "truncated"
        return "ongoing"

    def _result(self, observation: str) -> StepResult:
        self._info["state_key"] = self._state_key()
        return StepResult(observation, self._score, self._done, dict(self._info))

    def _state_key(self) -> str:
        """The grid (objects, doors), the agent's cell, heading and load: equal exactly when the state is."""
        env = self._env
        grid = hashlib.sha1(env.grid.encode().tobytes()).hexdigest()[:16]
        carrying = env.carrying.encode() if env.carrying is not None else None
        return f"{self._info['task_id']}|{tuple(int(x) for x in env.agent_pos)}|{int(env.agent_dir)}|{carrying}|{grid}"
