"""TextCraft: the recipe book, reproducible tasks, the original's messages, and the scripted solver."""

from __future__ import annotations

import collections

import pytest

from environments.base import InvalidTaskError, make_env
from environments.react import FORMAT_REMINDER
from environments.textcraft.env import TextCraft, crafting_commands
from environments.textcraft.recipes import RecipeDataError, load_recipe_book
from environments.textcraft.solver import solve


@pytest.fixture(scope="module")
def env() -> TextCraft:
    return make_env("textcraft")


def act(env: TextCraft, action: str):
    return env.step(f"Thought: let me act.\n\nAction:\n{action}")


def test_recipe_book_counts() -> None:
    book = load_recipe_book()
    goals = book.goals()
    assert len(goals) == 544
    assert collections.Counter(d for _, d in goals) == {1: 125, 2: 291, 3: 117, 4: 11}
    assert book.depth["minecraft:stick"] == 1 and book.depth["minecraft:anvil"] == 3
    assert "minecraft:iron_nugget" in book.base_items  # the ingot <-> nugget loop is broken at the nugget
    assert "minecraft:oak_planks" in book.tags["minecraft:planks"]


def test_tasks_cover_every_goal_with_disjoint_splits(env: TextCraft) -> None:
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (436, 108)
    assert not {t.task_id for t in train} & {t.task_id for t in test}
    assert sorted(t.task_id for t in train + test) == list(range(544))
    assert {t.subtask for t in test} == {"depth-1", "depth-2", "depth-3", "depth-4"}


def test_first_observation_format(env: TextCraft) -> None:
    observation, info = env.reset(300)
    assert info == {"task_id": 300, "goal": "minecraft:mossy_stone_bricks", "subtask": "depth-2", "split": "train",
                    "state_key": "minecraft:mossy_stone_bricks|[]|False"}
    assert observation.startswith("Crafting commands:\n") and observation.endswith("\n\nGoal: craft mossy stone bricks.")
    commands = observation.split("\n\n")[0].splitlines()[1:]
    assert "craft 1 mossy stone bricks using 1 stone bricks, 1 vine" in commands
    assert "craft 4 stone bricks using 4 stone" in commands
    assert len(commands) == len(set(commands)) == 12  # 2 tree recipes + 10 distractors


def test_command_list_is_a_pure_function_of_the_task_id() -> None:
    book = load_recipe_book()
    assert crafting_commands(book, "minecraft:anvil", 17) == crafting_commands(book, "minecraft:anvil", 17)
    assert crafting_commands(book, "minecraft:anvil", 17) != crafting_commands(book, "minecraft:anvil", 18)


def test_original_messages(env: TextCraft) -> None:
    env.reset(0)  # goal: acacia planks, from 1 acacia logs
    assert act(env, "inventory").observation == "Inventory: You are not carrying anything."
    assert act(env, "dance wildly").observation == "Could not execute dance wildly"
    assert act(env, "get 1 diamond pickaxe").observation == "Could not find diamond pickaxe"
    assert act(env, "get 2 stick").observation == "Could not find stick"  # craftable items must be crafted
    assert act(env, "craft 1 stick using 2 dirt").observation == "Could not find enough items to craft minecraft:stick"
    assert act(env, "craft 1 stick using two dirt").observation == "Wrong item format: two dirt"
    got = act(env, "get 2 acacia logs")
    assert (got.observation, got.reward, got.done) == ("Got 2 acacia logs", 0.0, False)
    assert act(env, "inventory").observation == "Inventory: [acacia logs] (2) "
    wrong = act(env, "craft 4 acacia planks using 2 acacia logs")  # counts must match the recipe exactly
    assert wrong.observation == "Could not find a valid recipe for 4 acacia planks" and not wrong.done
    done = act(env, "craft 4 acacia planks using 1 acacia logs")
    assert (done.observation, done.reward, done.done) == ("Crafted 4 minecraft:acacia_planks", 1.0, True)
    after = act(env, "inventory")  # steps after the goal are accepted; the outcome stays
    assert (after.observation, after.reward, after.done) == ("Inventory: [acacia logs] (1) [acacia planks] (4) ", 1.0, True)


def test_tag_ingredients_take_any_member(env: TextCraft) -> None:
    env.reset(env.all_tasks()[[t for t, _ in env.book.goals()].index("minecraft:stick")].task_id)
    act(env, "get 1 oak logs")
    act(env, "craft 4 oak planks using 1 oak logs")
    assert act(env, "craft 4 stick using 2 planks").observation == "Could not find enough items to craft minecraft:stick"
    result = act(env, "craft 4 stick using 2 oak planks")
    assert (result.observation, result.reward, result.done) == ("Crafted 4 minecraft:stick", 1.0, True)


def test_react_parsing(env: TextCraft) -> None:
    env.reset(0)
    assert env.step("I think I should get logs").observation == FORMAT_REMINDER
    last = env.step("Action: inventory\nThought: no, rather\nAction:\n  Get 1 Acacia-Logs!!  \nmore text")
    assert last.observation == "Got 1 acacia logs"  # the last Action:, one line, sanitized and lower-cased


def test_scripted_solver_solves_every_task(env: TextCraft) -> None:
    longest = 0
    for task in env.all_tasks():
        _, info = env.reset(task.task_id)
        plan = solve(env.book, info["goal"])
        longest = max(longest, len(plan))
        results = [act(env, a) for a in plan]
        assert [r.done for r in results] == [False] * (len(plan) - 1) + [True], info["goal"]
        assert results[-1].reward == 1.0
    assert longest == 91


def test_bad_task_ids_and_recipe_dir(env: TextCraft, tmp_path) -> None:
    for bad in (-1, 544, "3", True):
        with pytest.raises(InvalidTaskError, match=r"valid ids are 0\.\.543"):
            env.reset(bad)
    with pytest.raises(RecipeDataError, match="no recipe JSON files"):
        make_env("textcraft", recipe_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown split"):
        env.tasks("validation")
