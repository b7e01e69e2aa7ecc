"""A scripted TextCraft solver that plans over the recipe tree (used by tests and as a sanity baseline)."""

from __future__ import annotations

import math

from environments.textcraft.recipes import Ingredient, Recipe, RecipeBook, display_name


class UnsolvableGoalError(RuntimeError):
    """Raised when the solver finds no way to make an item from base items."""


def _cheapest_recipe(book: RecipeBook, item: str) -> Recipe:
    recipes = book.recipes_for.get(item, ())
    if not recipes:
        raise UnsolvableGoalError(f"{item} has no recipe and is not a base item")
    return min(recipes, key=lambda r: (max(book.depth_of(i.name) for i in r.ingredients), r.command))


def _concrete_item(book: RecipeBook, ingredient: Ingredient) -> str:
    if not ingredient.is_tag:
        return ingredient.name
    return min(book.tags[ingredient.name], key=lambda m: (book.depth_of(m), m))


def solve(book: RecipeBook, goal: str) -> list[str]:
    """Actions that craft ``goal`` from nothing: ``get`` the base items, then ``craft`` bottom-up."""
    inventory: dict[str, int] = {}
    actions: list[str] = []

    def obtain(item: str, count: int) -> None:
        have = inventory.get(item, 0)
        if have >= count:
            return
        if item in book.base_items:
            actions.append(f"get {count - have} {display_name(item)}")
            inventory[item] = count
            return
        recipe = _cheapest_recipe(book, item)
        for _ in range(math.ceil((count - have) / recipe.output_count)):
            parts = []
            for ingredient in recipe.ingredients:
                concrete = _concrete_item(book, ingredient)
                obtain(concrete, ingredient.count)
                inventory[concrete] -= ingredient.count
                parts.append(f"{ingredient.count} {display_name(concrete)}")
            actions.append(f"craft {recipe.output_count} {display_name(item)} using {', '.join(parts)}")
            inventory[item] = inventory.get(item, 0) + recipe.output_count

    obtain(goal, 1)
    return actions
