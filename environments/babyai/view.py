"""What the agent sees: the objects of minigrid's egocentric 7x7 view, named and placed relative to it.

Objects are named ``"<colour> <type>"`` (doors ``"<colour> <open|closed|locked> door"``) and numbered per
name, nearest first (``red ball 1`` is the nearest visible red ball). Positions are given in steps ahead
and to the left/right of the agent. Only cells minigrid marks visible (walls and closed doors occlude)
are described or used for planning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from minigrid.core.constants import DIR_TO_VEC

# Object types that are named in observations and actions (walls, floor and empty cells are not).
NAMED_TYPES = ("door", "key", "ball", "box", "goal", "lava")
PICKABLE_TYPES = ("key", "ball", "box")

Pos = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class SeenObject:
    """One visible object: its name and index, absolute cell and offset from the agent."""

    name: str  # e.g. "red ball", "blue locked door"
    index: int  # 1-based, per name, nearest first
    obj_type: str
    color: str
    pos: Pos  # absolute grid cell
    ahead: int  # steps in front of the agent (0..6)
    right: int  # steps to the right (negative: to the left)
    world_obj: Any  # the minigrid WorldObj (same object as in the grid)

    @property
    def label(self) -> str:
        """The name used in actions, e.g. ``"red ball 1"``."""
        return f"{self.name} {self.index}"


@dataclasses.dataclass(frozen=True)
class View:
    """The agent's current view: pose, visible objects, walkable visible cells, what it carries."""

    agent_pos: Pos
    agent_dir: int
    objects: tuple[SeenObject, ...]
    walkable: frozenset[Pos]  # visible cells the agent may enter (empty, open door, goal, floor)
    ahead_cells: tuple[tuple[Pos, Any, bool], ...]  # cells straight ahead: (pos, WorldObj|None, visible)
    carrying: Any  # WorldObj or None

    @property
    def front_pos(self) -> Pos:
        """The cell right in front of the agent."""
        dx, dy = DIR_TO_VEC[self.agent_dir]
        return (self.agent_pos[0] + int(dx), self.agent_pos[1] + int(dy))

    @property
    def front_cell(self) -> Any:
        """The minigrid WorldObj right in front of the agent (None when the cell is empty)."""
        return self.ahead_cells[0][1]

    def object_at(self, pos: Pos) -> SeenObject | None:
        """The visible named object at ``pos``, if any."""
        for seen in self.objects:
            if seen.pos == pos:
                return seen
        return None


def object_name(world_obj: Any) -> str:
    """``"red ball"`` for objects, ``"red open door"`` / ``"red closed door"`` / ``"red locked door"``."""
    if world_obj.type == "door":
        state = "open" if world_obj.is_open else ("locked" if world_obj.is_locked else "closed")
        return f"{world_obj.color} {state} door"
    return f"{world_obj.color} {world_obj.type}"


def observe(env: Any) -> View:
    """Builds the :class:`View` of an (unwrapped) minigrid environment from its egocentric view grid."""
    grid, vis_mask = env.gen_obs_grid()
    size = grid.width  # agent_view_size (7)
    center = size // 2
    ax, ay = int(env.agent_pos[0]), int(env.agent_pos[1])
    fx, fy = (int(v) for v in DIR_TO_VEC[env.agent_dir])
    rx, ry = -fy, fx  # right vector: forward rotated clockwise (y grows downwards)

    found: list[tuple[int, int, int, Any, Pos]] = []
    walkable: set[Pos] = {(ax, ay)}
    ahead_cells: list[tuple[Pos, Any, bool]] = []
    for j in range(size):
        for i in range(size):
            ahead, right = size - 1 - j, i - center
            if ahead == 0 and right == 0:
                continue  # the agent's own cell (minigrid puts the carried object there)
            pos = (ax + ahead * fx + right * rx, ay + ahead * fy + right * ry)
            visible = bool(vis_mask[i, j])
            cell = grid.get(i, j)
            if right == 0:
                ahead_cells.append((pos, cell, visible))
            if not visible:
                continue
            if cell is None or (cell.can_overlap() and cell.type != "lava"):
                walkable.add(pos)
            if cell is not None and cell.type in NAMED_TYPES:
                found.append((ahead + abs(right), ahead, right, cell, pos))

    found.sort(key=lambda item: (item[0], item[1], item[2]))  # nearest first, then ahead, then left-to-right
    counts: dict[str, int] = {}
    objects = []
    for _, ahead, right, cell, pos in found:
        name = object_name(cell)
        counts[name] = counts.get(name, 0) + 1
        objects.append(SeenObject(name, counts[name], cell.type, cell.color, pos, ahead, right, cell))
    ahead_cells.sort(key=lambda item: abs(item[0][0] - ax) + abs(item[0][1] - ay))
    return View(
        agent_pos=(ax, ay),
        agent_dir=int(env.agent_dir),
        objects=tuple(objects),
        walkable=frozenset(walkable),
        ahead_cells=tuple(ahead_cells),
        carrying=env.carrying,
    )


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def _where(seen: SeenObject) -> str:
    parts = []
    if seen.ahead:
        parts.append(f"{_steps(seen.ahead)} in front of you")
    if seen.right > 0:
        parts.append(f"{_steps(seen.right)} to your right")
    elif seen.right < 0:
        parts.append(f"{_steps(-seen.right)} to your left")
    return " and ".join(parts)


def describe(view: View) -> str:
    """The text observation of ``view``: visible objects, the wall ahead, and what the agent carries."""
    if view.objects:
        lines = [f"There is a {seen.label} {_where(seen)}." for seen in view.objects]
        sentences = "You can see the following objects: " + " ".join(lines)
    else:
        sentences = "You cannot see any objects within sight."
    wall_note = ""
    for steps, (_, cell, visible) in enumerate(view.ahead_cells, start=1):
        if not visible:
            break
        if cell is not None and cell.type == "wall":
            wall_note = f" You are facing a wall {_steps(steps)} away."
            break
        if cell is not None and not cell.can_overlap():
            break  # an object or closed door blocks the way; it is listed above
    if view.carrying is None:
        carry = " You are not carrying anything."
    else:
        carry = f" You are carrying a {view.carrying.color} {view.carrying.type}."
    return sentences + wall_note + carry
