"""SciWorld (ScienceWorld on Java 17); importing this registers ``"sciworld"``."""

from environments.sciworld.env import INSTRUCTION, ORIGINAL_EXCLUDED_TASKS, SciWorld

__all__ = ["INSTRUCTION", "ORIGINAL_EXCLUDED_TASKS", "SciWorld"]
