"""Macro actions: a breadth-first planner over primitive minigrid actions within the visible cells.

The search runs over agent poses ``(x, y, direction)`` with the primitives ``move forward``, ``turn left``
and ``turn right``, entering only visible walkable cells, so a macro never walks into the unknown. One
search per observation serves every target. From it, :func:`macro_actions` builds the actions that are
executable now (each with its primitive sequence) and, for macros that name a visible object but cannot
run, the reason, which becomes the invalid-action message.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

from minigrid.core.actions import Actions
from minigrid.core.constants import DIR_TO_VEC

from environments.babyai.view import PICKABLE_TYPES, Pos, SeenObject, View

Pose = tuple[int, int, int]

LEFT, RIGHT, FORWARD = int(Actions.left), int(Actions.right), int(Actions.forward)
PICKUP, DROP, TOGGLE, DONE = int(Actions.pickup), int(Actions.drop), int(Actions.toggle), int(Actions.done)

CHECK_ACTIONS = "check available actions"


def _forward(pose: Pose) -> Pos:
    dx, dy = DIR_TO_VEC[pose[2]]
    return (pose[0] + int(dx), pose[1] + int(dy))


@dataclasses.dataclass
class PoseSearch:
    """Breadth-first search tree of poses reachable from the agent through walkable visible cells."""

    start: Pose
    parent: dict[Pose, tuple[Pose, int]]
    order: dict[Pose, int]  # discovery rank: BFS order, so lower rank means fewer primitive steps

    @classmethod
    def run(cls, start: Pose, walkable: frozenset[Pos]) -> "PoseSearch":
        """Explores all poses reachable from ``start``."""
        parent: dict[Pose, tuple[Pose, int]] = {}
        order = {start: 0}
        queue = collections.deque([start])
        while queue:
            pose = queue.popleft()
            x, y, d = pose
            successors = ((*_forward(pose), d, FORWARD), (x, y, (d - 1) % 4, LEFT), (x, y, (d + 1) % 4, RIGHT))
            for nx, ny, nd, action in successors:
                nxt = (nx, ny, nd)
                if nxt in order or (action == FORWARD and (nx, ny) not in walkable):
                    continue
                order[nxt] = len(order)
                parent[nxt] = (pose, action)
                queue.append(nxt)
        return cls(start, parent, order)

    def path_to(self, goals: Iterable[Pose]) -> list[int] | None:
        """Primitive actions to the earliest-discovered (hence nearest) reachable goal pose, or None."""
        reached = [goal for goal in goals if goal in self.order]
        if not reached:
            return None
        pose = min(reached, key=self.order.__getitem__)
        path: list[int] = []
        while pose != self.start:
            pose, action = self.parent[pose]
            path.append(action)
        return path[::-1]

    def path_to_face(self, target: Pos) -> list[int] | None:
        """Path to a pose adjacent to ``target`` and facing it."""
        goals = []
        for d, (dx, dy) in enumerate(DIR_TO_VEC):
            goals.append((target[0] - int(dx), target[1] - int(dy), d))
        return self.path_to(goals)

    def path_onto(self, target: Pos) -> list[int] | None:
        """Path that ends standing on ``target`` (which must be walkable)."""
        return self.path_to((target[0], target[1], d) for d in range(4))


@dataclasses.dataclass
class MacroTable:
    """Executable actions (name -> primitive sequence) and reasons for visible but impossible ones."""

    actions: dict[str, list[int]]
    reasons: dict[str, str]

    def names(self) -> list[str]:
        """The available action strings, in display order."""
        return list(self.actions)


def _no_path(verb: str, label: str) -> str:
    return f"You cannot {verb} {label}, as there is no path leading to it."


def macro_actions(view: View) -> MacroTable:
    """All actions executable in ``view``, each mapped to its primitive actions."""
    search = PoseSearch.run((*view.agent_pos, view.agent_dir), view.walkable)
    actions: dict[str, list[int]] = {"turn left": [LEFT], "turn right": [RIGHT]}
    reasons: dict[str, str] = {}
    front = view.front_pos
    front_obj = view.object_at(front)
    carrying = view.carrying

    if front in view.walkable:
        actions["move forward"] = [FORWARD]
    else:
        reasons["move forward"] = "There is a barrier in front of you, you can't move forward."

    toggle_reason = _toggle_blocker(front_obj, carrying)
    if toggle_reason is None:
        actions["toggle"] = [TOGGLE]
    else:
        reasons["toggle"] = toggle_reason

    if carrying is None:
        reasons["drop"] = "You cannot drop the object, as you are not carrying anything."
    elif view.front_cell is not None:  # minigrid drops only onto an empty cell
        reasons["drop"] = "You cannot drop the object, as there is already an object in front of you."
    else:
        actions["drop"] = [DROP]

    for seen in view.objects:
        _add_object_actions(seen, search, carrying, actions, reasons)

    actions[CHECK_ACTIONS] = []
    return MacroTable(actions, reasons)


def _toggle_blocker(front_obj: SeenObject | None, carrying: object) -> str | None:
    """None if toggling the cell ahead changes something useful, else the reason it is not offered."""
    if front_obj is None:
        return "There is nothing in front of you that can be toggled."
    if front_obj.obj_type == "box":
        return None
    if front_obj.obj_type != "door":
        return f"You cannot toggle the {front_obj.label}."
    door = front_obj.world_obj
    if door.is_open:
        return f"The {front_obj.label} is already open."
    if door.is_locked:
        return _key_problem(front_obj, carrying, "toggle")
    return None


def _key_problem(door: SeenObject, carrying: object, verb: str) -> str | None:
    """Why a locked door cannot be opened with what the agent carries (None if it can)."""
    if carrying is None or carrying.type != "key":
        return f"You cannot {verb} {door.label}, as you are not carrying a key."
    if carrying.color != door.color:
        return (
            f"You cannot {verb} {door.label}, as the color of the key you are carrying does not match "
            "the color of the door."
        )
    return None


def _add_object_actions(
    seen: SeenObject,
    search: PoseSearch,
    carrying: object,
    actions: dict[str, list[int]],
    reasons: dict[str, str],
) -> None:
    label = seen.label
    if seen.obj_type == "goal":
        path = search.path_onto(seen.pos)
        if path is None:
            reasons.setdefault("go to goal", "You cannot go to the goal, as there is no path leading to it.")
        else:
            actions.setdefault("go to goal", path)
        return

    face = search.path_to_face(seen.pos)
    if face is None:
        reasons[f"go to {label}"] = _no_path("go to", label)
    else:
        # Already facing it: "go to" spends one no-op primitive so that minigrid checks the goal.
        actions[f"go to {label}"] = face or [DONE]

    if seen.obj_type in PICKABLE_TYPES:
        name = f"pickup {label}"
        if carrying is not None:
            reasons[name] = (
                f"You cannot pickup {label}, as you are already carrying a {carrying.color} {carrying.type}. "
                "Drop it first."
            )
        elif face is None:
            reasons[name] = _no_path("pickup", label)
        else:
            actions[name] = face + [PICKUP]

    if seen.obj_type != "door":
        return
    door = seen.world_obj
    through, toggle_through = f"go through {label}", f"toggle and go through {label}"
    if door.is_open:
        onto = search.path_onto(seen.pos)
        if onto is None:
            reasons[through] = _no_path("go through", label)
        else:
            actions[through] = onto + [FORWARD]
        reasons[toggle_through] = f"You cannot toggle and go through {label}, as it is already open."
        return
    state = "locked" if door.is_locked else "closed"
    reasons[through] = f"You cannot go through {label}, as it is {state}. You should toggle it first."
    problem = _key_problem(seen, carrying, "toggle and go through") if door.is_locked else None
    if problem is not None:
        reasons[toggle_through] = problem
    elif face is None:
        reasons[toggle_through] = _no_path("toggle and go through", label)
    else:
        actions[toggle_through] = face + [TOGGLE, FORWARD, FORWARD]
