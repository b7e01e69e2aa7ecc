"""BabyAI on minigrid: the original's 40 levels and task ids, text observations, planner macro actions.

Importing this package registers the environment as ``"babyai"`` (see :func:`environments.base.make_env`).
"""

from environments.babyai.env import BabyAIEnvironment, EpisodeStateError
from environments.babyai.levels import LEVELS, NUM_LEVELS, SUBTASKS, Level, SplitConfig, level_and_seed
from environments.babyai.parsing import ActionMatchingError, extract_action, match_action

__all__ = [
    "ActionMatchingError",
    "BabyAIEnvironment",
    "EpisodeStateError",
    "LEVELS",
    "Level",
    "NUM_LEVELS",
    "SUBTASKS",
    "SplitConfig",
    "extract_action",
    "level_and_seed",
    "match_action",
]
