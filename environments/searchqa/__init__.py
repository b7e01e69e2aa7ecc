"""Deep Search (SearchQA); importing this registers ``"searchqa"``."""

from environments.searchqa.env import INSTRUCTION, SearchQA

__all__ = ["INSTRUCTION", "SearchQA"]
