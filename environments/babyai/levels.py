"""The 40 BabyAI levels of the original task-id scheme, their subtask categories and the train/test splits.

A task id maps to ``level = LEVELS[task_id % 40]`` and ``seed = task_id // 40`` (the original indexes a
1-based dict with ``data_idx % 40 + 1``; this list is its 0-based equivalent, in the same order).

The order is the original AgentGym list, from ``BabyAI-GoToRedBallGrey-v0`` to
``BabyAI-BossLevelNoUnlock-v0``, checked against what ``minigrid==3.2.0`` registers. One entry differs:
the original's ``BabyAI-GoToObjS6-v0`` is registered by minigrid 3.x only as ``BabyAI-GoToObjS6-v1``
(the same ``GoToObj`` level with ``room_size=6``), so that id is used.

Known upstream behaviour kept as is: in ``BabyAI-OpenDoorsOrderN4Debug-v0`` (index 15) the two-door
missions ("open X, then open Y" / "open Y after you open X") use minigrid's strict verifier, which
re-checks the toggle that opened the first door against the second door and declares failure, so only
its one-door missions can be won (minigrid 3.2.0; ``tests/test_babyai.py`` pins this).

Subtask categories (the paper's GoTo, Pickup, AOD, Find, Room, SLoc), chosen per level:

- ``GoTo``: go to an object or door that lies in the agent's room (single-room GoTo levels, and
  GoToRedBlueBall / GoToDoor / GoToObjDoor).
- ``Pickup``: pick up a described object (Pickup, UnblockPickup, PickupLoc, PickupDist, PickupAbove).
- ``AOD`` ("act on door/object"): open doors, unlock doors, put objects next to others, act on an
  object or door (the Open*, PutNext*, Unlock*, KeyInBox, BlockedUnlockPickup, ActionObjDoor levels).
- ``Find``: locate an object hidden somewhere in a maze or a set of rooms, or in one very large room
  (GoToObjMaze, FindObj, KeyCorridor, OneRoomS20).
- ``Room``: navigation across several rooms to fulfil a (possibly sequential) instruction
  (GoToImpUnlock, GoToSeqS5R2, MoveTwoAcross).
- ``SLoc``: the synthetic-language levels built from the full instruction grammar with location
  phrases and sequences (Synth, SynthLoc, SynthSeq and the Boss levels, which are SynthSeq on larger
  mazes).
"""

from __future__ import annotations

import dataclasses

from environments.base import Task, check_split

SUBTASKS = ("GoTo", "Pickup", "AOD", "Find", "Room", "SLoc")


@dataclasses.dataclass(frozen=True)
class Level:
    """One BabyAI level: its gymnasium id and subtask category."""

    gym_id: str
    subtask: str


LEVELS: tuple[Level, ...] = (
    Level("BabyAI-GoToRedBallGrey-v0", "GoTo"),  # 0
    Level("BabyAI-GoToRedBall-v0", "GoTo"),  # 1
    Level("BabyAI-GoToRedBallNoDists-v0", "GoTo"),  # 2
    Level("BabyAI-GoToObjS6-v1", "GoTo"),  # 3 (original: GoToObjS6-v0, not registered in minigrid 3.x)
    Level("BabyAI-GoToLocalS8N7-v0", "GoTo"),  # 4
    Level("BabyAI-GoToObjMazeS7-v0", "Find"),  # 5
    Level("BabyAI-GoToImpUnlock-v0", "Room"),  # 6
    Level("BabyAI-GoToSeqS5R2-v0", "Room"),  # 7
    Level("BabyAI-GoToRedBlueBall-v0", "GoTo"),  # 8
    Level("BabyAI-GoToDoor-v0", "GoTo"),  # 9
    Level("BabyAI-GoToObjDoor-v0", "GoTo"),  # 10
    Level("BabyAI-Open-v0", "AOD"),  # 11
    Level("BabyAI-OpenRedDoor-v0", "AOD"),  # 12
    Level("BabyAI-OpenDoorLoc-v0", "AOD"),  # 13
    Level("BabyAI-OpenRedBlueDoorsDebug-v0", "AOD"),  # 14
    Level("BabyAI-OpenDoorsOrderN4Debug-v0", "AOD"),  # 15
    Level("BabyAI-Pickup-v0", "Pickup"),  # 16
    Level("BabyAI-UnblockPickup-v0", "Pickup"),  # 17
    Level("BabyAI-PickupLoc-v0", "Pickup"),  # 18
    Level("BabyAI-PickupDistDebug-v0", "Pickup"),  # 19
    Level("BabyAI-PickupAbove-v0", "Pickup"),  # 20
    Level("BabyAI-PutNextLocalS6N4-v0", "AOD"),  # 21
    Level("BabyAI-PutNextS7N4Carrying-v0", "AOD"),  # 22
    Level("BabyAI-Unlock-v0", "AOD"),  # 23
    Level("BabyAI-UnlockLocalDist-v0", "AOD"),  # 24
    Level("BabyAI-KeyInBox-v0", "AOD"),  # 25
    Level("BabyAI-UnlockPickupDist-v0", "AOD"),  # 26
    Level("BabyAI-BlockedUnlockPickup-v0", "AOD"),  # 27
    Level("BabyAI-UnlockToUnlock-v0", "AOD"),  # 28
    Level("BabyAI-ActionObjDoor-v0", "AOD"),  # 29
    Level("BabyAI-FindObjS7-v0", "Find"),  # 30
    Level("BabyAI-KeyCorridorS6R3-v0", "Find"),  # 31
    Level("BabyAI-OneRoomS20-v0", "Find"),  # 32
    Level("BabyAI-MoveTwoAcrossS8N9-v0", "Room"),  # 33
    Level("BabyAI-SynthS5R2-v0", "SLoc"),  # 34
    Level("BabyAI-SynthLoc-v0", "SLoc"),  # 35
    Level("BabyAI-SynthSeq-v0", "SLoc"),  # 36
    Level("BabyAI-MiniBossLevel-v0", "SLoc"),  # 37
    Level("BabyAI-BossLevel-v0", "SLoc"),  # 38
    Level("BabyAI-BossLevelNoUnlock-v0", "SLoc"),  # 39
)

NUM_LEVELS = len(LEVELS)

# Largest seed accepted by reset (gymnasium seeds must fit numpy's seeding; ids stay well inside int64).
MAX_SEED = 2**31 - 1


def level_and_seed(task_id: int) -> tuple[Level, int]:
    """The level and minigrid seed of a task id (``id % 40`` and ``id // 40``)."""
    return LEVELS[task_id % NUM_LEVELS], task_id // NUM_LEVELS


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Which seeds each split uses; test takes seeds ``[0, num_test_seeds)``, train the next ones.

    Every seed contributes all 40 levels, so each split is balanced over levels and subtasks, and the
    two splits never share a task id (their seed ranges are disjoint by construction).
    """

    num_test_seeds: int = 3
    num_train_seeds: int = 100

    def __post_init__(self) -> None:
        for name in ("num_test_seeds", "num_train_seeds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def seeds(self, split: str) -> range:
        """The seed range of ``split``."""
        check_split(split)
        if split == "test":
            return range(0, self.num_test_seeds)
        return range(self.num_test_seeds, self.num_test_seeds + self.num_train_seeds)

    def tasks(self, split: str) -> list[Task]:
        """All tasks of ``split``, ordered by task id."""
        seeds = self.seeds(split)
        first, last = seeds.start * NUM_LEVELS, seeds.stop * NUM_LEVELS
        return [Task(task_id, split, LEVELS[task_id % NUM_LEVELS].subtask) for task_id in range(first, last)]
