"""TextCraft: craft a Minecraft item from base items, given a list of crafting commands.

Task ``i`` is the i-th craftable item in the order (crafting depth, item id); its subtask is
``depth-<d>``. The command list is the goal's recipe tree plus up to 10 distractor recipes that use the
same ingredients, shuffled by a ``random.Random`` seeded with the task id over sorted inputs, so the
first observation is identical in every process and under any ``PYTHONHASHSEED``.

Within every depth, tasks are sorted by item id and every 5th one (positions 2, 7, 12, ...) is a test
task; the rest are train tasks. The two lists never overlap.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any, Sequence

from environments.base import Environment, InvalidTaskError, StepResult, Task, check_split, register
from environments.react import FORMAT_REMINDER, parse_single_line_action
from environments.textcraft.recipes import RecipeBook, display_name, item_id_of, load_recipe_book

MAX_DISTRACTORS = 10
TEST_EVERY = 5
UNKNOWN_COMMAND = "Could not execute"  # how a command the crafting world does not know is answered

INSTRUCTION = """You are in a Minecraft crafting world. Each task gives you a list of crafting commands and a goal item; your job is to end up crafting the goal item.

You can take these actions:
- get <count> <item>: fetch base items from the environment, e.g. "get 2 oak logs". Only base items can be fetched; items that have a recipe must be crafted.
- craft <count> <item> using <count> <ingredient>, <count> <ingredient>, ...: use exactly the ingredients and counts of one crafting command, e.g. "craft 4 oak planks using 1 oak logs". One command crafts one batch.
- inventory: list what you are carrying.

Where a command names a general kind of ingredient (for example "planks"), use a specific item of that kind (for example "oak planks").

Every turn, first think, then give exactly one action. Your response should use the following format:

Thought:
<your reasoning>

Action:
<one action>"""

_GET = re.compile(r"get (\d+) ([a-z0-9 ]+)")
_CRAFT = re.compile(r"craft (.+?) using (.+)")
_COUNTED = re.compile(r"(\d+) ([a-z0-9 ]+)")


@functools.lru_cache(maxsize=4)
def _task_list(recipe_dir: str | None) -> tuple[Task, ...]:
    book = load_recipe_book(recipe_dir)
    tasks = []
    position_in_depth: dict[int, int] = {}
    for task_id, (_, depth) in enumerate(book.goals()):
        position = position_in_depth.get(depth, 0)
        position_in_depth[depth] = position + 1
        split = "test" if position % TEST_EVERY == 2 else "train"
        tasks.append(Task(task_id=task_id, split=split, subtask=f"depth-{depth}"))
    return tuple(tasks)


def crafting_commands(book: RecipeBook, goal: str, task_id: int) -> list[str]:
    """The goal's recipe tree plus distractors, in the task's reproducible shuffled order."""
    tree = sorted({recipe.command for recipe in book.recipe_tree(goal)})
    names = sorted({ing.name for recipe in book.recipe_tree(goal) for ing in recipe.ingredients})
    candidates = sorted(
        {use.command for name in names for use in book.uses.get(name, ())} - set(tree)
    )
    rng = random.Random(task_id)
    commands = tree + rng.sample(candidates, min(len(candidates), MAX_DISTRACTORS))
    rng.shuffle(commands)
    return commands


@register("textcraft")
class TextCraft(Environment):
    """Our reproducible TextCraft over the `textcraft` package's recipe files."""

    name = "textcraft"

    def __init__(self, recipe_dir: str | None = None) -> None:
        self._recipe_dir = recipe_dir
        self.book = load_recipe_book(recipe_dir)
        self._goals = self.book.goals()
        self.goal: str | None = None
        self.inventory: dict[str, int] = {}
        self._done = False
        self._observation = ""

    def instruction(self) -> str:
        return INSTRUCTION

    def tasks(self, split: str) -> Sequence[Task]:
        check_split(split)
        return [task for task in _task_list(self._recipe_dir) if task.split == split]

    def all_tasks(self) -> Sequence[Task]:
        """Every task of both splits, in task-id order."""
        return _task_list(self._recipe_dir)

    def goal_of(self, task_id: int) -> str:
        """The goal item id of a task (e.g. ``minecraft:stick``)."""
        if not isinstance(task_id, int) or isinstance(task_id, bool) or not 0 <= task_id < len(self._goals):
            raise InvalidTaskError(
                f"textcraft task id {task_id!r} is out of range; valid ids are 0..{len(self._goals) - 1}"
            )
        return self._goals[task_id][0]

    def task_details(self, task_id: int) -> dict[str, Any]:
        """What a task file records about a task besides id, split and subtask."""
        return {"goal": self.goal_of(task_id)}

    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        self.goal = self.goal_of(task_id)
        self.inventory = {}
        self._done = False
        commands = crafting_commands(self.book, self.goal, task_id)
        self._observation = "Crafting commands:\n{}\n\nGoal: craft {}.".format(
            "\n".join(commands), display_name(self.goal)
        )
        task = _task_list(self._recipe_dir)[task_id]
        info = {"task_id": task_id, "goal": self.goal, "subtask": task.subtask, "split": task.split,
                "state_key": self._state_key()}
        return self._observation, info

    def step(self, action_text: str) -> StepResult:
        if self.goal is None:
            raise RuntimeError("TextCraft.step called before reset; call reset(task_id) first")
        action = parse_single_line_action(action_text)
        if action is None:
            observation, crafted_goal = FORMAT_REMINDER, False
        else:
            observation, crafted_goal = self.execute(action)
        self._done = self._done or crafted_goal
        self._observation = observation
        reward = 1.0 if self._done else 0.0
        understood = action is not None and not observation.startswith(UNKNOWN_COMMAND)
        return StepResult(observation, reward, self._done,
                          {"action": action, "action_valid": understood, "success": reward >= 1.0,
                           "state_key": self._state_key()})

    def _state_key(self) -> str:
        """Goal and inventory: the whole state of a crafting episode."""
        return f"{self.goal}|{sorted(self.inventory.items())}|{self._done}"

    def execute(self, action: str) -> tuple[str, bool]:
        """Runs one sanitized command; returns the message and whether it crafted the goal."""
        if action == "inventory":
            if not self.inventory:
                return "Inventory: You are not carrying anything.", False
            return "Inventory: " + "".join(f"[{display_name(i)}] ({n}) " for i, n in self.inventory.items()), False
        if match := _GET.fullmatch(action):
            return self._get(int(match.group(1)), match.group(2).strip()), False
        if match := _CRAFT.fullmatch(action):
            return self._craft(match.group(1).strip(), match.group(2))
        return f"{UNKNOWN_COMMAND} {action}", False

    def _get(self, count: int, name: str) -> str:
        item = item_id_of(name)
        if count < 1 or item not in self.book.base_items:
            return f"Could not find {name}"
        self.inventory[item] = self.inventory.get(item, 0) + count
        return f"Got {count} {name}"

    def _craft(self, output_text: str, inputs_text: str) -> tuple[str, bool]:
        counted = _COUNTED.fullmatch(output_text)
        output = item_id_of(counted.group(2) if counted else output_text)
        given: list[tuple[str, int]] = []
        for part in inputs_text.split(","):
            match = _COUNTED.fullmatch(part.strip())
            if match is None:
                return f"Wrong item format: {part.strip()}", False
            given.append((item_id_of(match.group(2)), int(match.group(1))))
        needed: dict[str, int] = {}
        for item, count in given:
            needed[item] = needed.get(item, 0) + count
        if any(self.inventory.get(item, 0) < count for item, count in needed.items()):
            return f"Could not find enough items to craft {output}", False
        recipe = next((r for r in self.book.recipes_for.get(output, ()) if self._fits(r, given)), None)
        if recipe is None:
            return f"Could not find a valid recipe for {output_text}", False
        for item, count in given:
            self.inventory[item] -= count
            if self.inventory[item] == 0:
                del self.inventory[item]
        self.inventory[output] = self.inventory.get(output, 0) + recipe.output_count
        return f"Crafted {recipe.output_count} {output}", output == self.goal

    def _fits(self, recipe, given: list[tuple[str, int]]) -> bool:
        """Whether the given (item, count) pairs are exactly the recipe's ingredients and counts."""
        if len(given) != len(recipe.ingredients):
            return False
        remaining = list(given)
        for ingredient in recipe.ingredients:
            match = next(
                (g for g in remaining if g[1] == ingredient.count and self.book.matches(ingredient, g[0])), None
            )
            if match is None:
                return False
            remaining.remove(match)
        return True
