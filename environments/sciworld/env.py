"""SciWorld: ScienceWorld's 30 science tasks (Java simulator) behind our environment protocol.

Task ids and splits (see catalog.py): our ``train`` split is the package's train variations and our
``test`` split its test variations, so they never overlap. The package's *dev* variations are in
neither; ``tasks("dev")`` returns them as a validation list for choosing checkpoints or tuning
prompts without touching the test set. By default the 7 tasks the original AgentGym left out
(5-1, 5-2, 9-1, 9-2, 9-3, 10-1, 10-2) are excluded from the lists (``exclude_tasks=()`` keeps all 30);
their ids still reset. The subtask is the task's topic (Matter, Measurement, Electricity,
Classification, Chemistry, Biology, and Forces when included).

Reward: ScienceWorld's task score (0..100) / 100; a failed task scores negative in ScienceWorld and
ends the episode, and gets reward 0 (the raw score is ``info["score"]``). Listing valid actions costs
~80-95 ms per call, so it only happens when the agent asks with ``check valid actions``.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any, Sequence

from environments.base import Environment, InvalidTaskError, StepResult, Task, register
from environments.react import FORMAT_REMINDER, MAX_ACTION_CHARS, first_line, text_after_last_action
from environments.sciworld.catalog import load_catalog, locate
from environments.sciworld.jvm import DEFAULT_JVM_OPTIONS, capped_jvm_options

ORIGINAL_EXCLUDED_TASKS = ("5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2")
CHECK_VALID_ACTIONS = "check valid actions"
_NON_PRINTABLE = re.compile(r"[^\x20-\x7e]")

INSTRUCTION = """You are a helpful assistant doing science experiments in a simulated world of rooms, objects, substances, plants and animals. Each task describes what to achieve; you act by giving text commands and read what happens.

Available actions (OBJ is an object, LOC a location):
- open OBJ / close OBJ: open or close a container or door
- activate OBJ / deactivate OBJ: switch a device on or off
- connect OBJ to OBJ / disconnect OBJ: wire electrical components
- use OBJ [on OBJ]: use a device, optionally on something
- look around: describe the current room
- look at OBJ / look in OBJ: describe an object or a container's contents
- read OBJ: read a note, book or label
- move OBJ to OBJ: move an object somewhere
- pick up OBJ / put down OBJ: take an object into or out of your inventory
- pour OBJ into OBJ / dunk OBJ into OBJ / mix OBJ: handle substances
- go to LOC: move to an adjacent location
- eat OBJ / flush OBJ / examine OBJ
- focus on OBJ: declare the object the task is about (only focus on what the task asks for; a wrong focus fails the task)
- wait / wait1: let time pass (10 steps / 1 step)
- task: repeat the task description
- inventory: list what you carry
- check valid actions: list the actions possible right now
When the simulator asks you to choose between ambiguous objects, answer with the number of your choice.

Every turn, first think, then give exactly one action. Your response should use the following format:

Thought:
<your reasoning>

Action:
<one action>"""


def _clean_action(text: str) -> str:
    """The first line of the action text, printable ASCII only, cut to a sane length."""
    return _NON_PRINTABLE.sub(" ", first_line(text)[:MAX_ACTION_CHARS]).strip()


@register("sciworld")
class SciWorld(Environment):
    """ScienceWorld through the `scienceworld` package; the JVM starts at the first reset."""

    name = "sciworld"

    def __init__(
        self,
        step_limit: int = 100,
        exclude_tasks: Sequence[str] = ORIGINAL_EXCLUDED_TASKS,
        simplifications: str = "",
        jvm_options: str = DEFAULT_JVM_OPTIONS,
        generate_gold_path: bool = False,
    ) -> None:
        known = {task.code for task in load_catalog()}
        unknown = sorted(set(exclude_tasks) - known)
        if unknown:
            raise ValueError(f"exclude_tasks has unknown ScienceWorld task codes {unknown}; known: {sorted(known)}")
        if step_limit < 1:
            raise ValueError(f"step_limit must be >= 1, got {step_limit}")
        self.step_limit = step_limit
        self.exclude_tasks = tuple(exclude_tasks)
        self.simplifications = simplifications
        self.jvm_options = jvm_options
        self.generate_gold_path = generate_gold_path
        self._env: Any = None
        self._task_id: int | None = None
        self._done = False
        self._last_observation = ""

    def instruction(self) -> str:
        return INSTRUCTION

    def tasks(self, split: str) -> Sequence[Task]:
        if split not in ("train", "test", "dev"):
            raise ValueError(f"unknown split {split!r}; use 'train', 'test' or 'dev' (validation)")
        return [
            Task(task_id=task.offset + variation, split=split, subtask=task.topic)
            for task in load_catalog()
            if task.code not in self.exclude_tasks
            for variation in task.variations[split]
        ]

    def task_details(self, task_id: int) -> dict[str, Any]:
        """What a task file records about a task besides id, split and subtask."""
        task, variation, variation_split = locate(task_id)
        return {"task_code": task.code, "task_name": task.name, "variation": variation}

    def _simulator(self) -> Any:
        if self._env is None:
            from scienceworld import ScienceWorldEnv

            with capped_jvm_options(self.jvm_options):
                self._env = ScienceWorldEnv("", envStepLimit=self.step_limit)
        return self._env

    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        try:
            if isinstance(task_id, bool) or not isinstance(task_id, int):
                raise IndexError(task_id)
            task, variation, variation_split = locate(task_id)
        except IndexError:
            total = sum(t.num_variations for t in load_catalog())
            raise InvalidTaskError(f"sciworld task id {task_id!r} is out of range; valid ids are 0..{total - 1}") from None
        env = self._simulator()
        env.load(task.name, variation, self.simplifications, generateGoldPath=self.generate_gold_path)
        env.server.reset()
        look = env.server.step("look around")
        description = env.server.freeActionTaskDesc()
        self._task_id, self._done = task_id, False
        self._last_observation = f"{description}\n{look}"
        info: dict[str, Any] = {
            "task_id": task_id,
            "task_code": task.code,
            "task_name": task.name,
            "variation": variation,
            "variation_split": variation_split,
            "subtask": task.topic,
            "task_description": description,
            "score": 0,
        }
        if self.generate_gold_path:
            info["gold_actions"] = list(env.server.getGoldActionSequence())
        info["state_key"] = self._state_key(0)
        return self._last_observation, info

    def step(self, action_text: str) -> StepResult:
        if self._task_id is None:
            raise RuntimeError("SciWorld.step called before reset; call reset(task_id) first")
        env = self._env
        after = text_after_last_action(action_text)
        action = None if after is None else _clean_action(after)
        if action is None:
            observation = FORMAT_REMINDER
        elif action.lower() == CHECK_VALID_ACTIONS:
            valid = sorted(set(env.server.getValidActionObjectCombinations()))
            observation = "Valid actions: " + ", ".join(valid)
        else:
            observation = env.server.step(action)
        score = int(round(100 * env.server.getScore()))
        moves = int(env.server.getNumMoves())
        self._done = self._done or bool(env.server.getCompleted()) or score < 0 or moves > self.step_limit
        self._last_observation = observation
        info = {"score": score, "moves": moves, "action": action, "action_valid": action is not None,
                "success": score >= 100,  # a partial score is progress, not a pass
                "state_key": self._state_key(score)}
        return StepResult(observation, max(score, 0) / 100.0, self._done, info)

    def _state_key(self, score: int) -> str:
        """Task, score, what the agent sees around it and carries (free actions: no simulated time passes)."""
        server = self._env.server
        return f"{self._task_id}|{score}|{server.freeActionLook()}|{server.freeActionInventory()}"

    def close(self) -> None:
        env, self._env = self._env, None
        if env is None:
            return
        process = env._gateway.java_process
        try:
            env.close()
        finally:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:  # a JVM that does not exit on request is killed
                process.kill()
                process.wait(timeout=5)
            env.close = lambda: None  # the package's __del__ would shut the gateway down a second time
