"""Parsing the ReAct turn format shared by the text environments.

The agent's turn looks like ``"Thought: ...\\n\\nAction:\\n<action>"``. The action is whatever follows the
*last* ``Action:`` marker; environments decide whether it is one line (TextCraft, BabyAI) or free text
(SciWorld) and how to clean it.
"""

from __future__ import annotations

import re

ACTION_MARKER = "Action:"
MAX_ACTION_CHARS = 300  # longer actions are cut before parsing; no real command is near this long

FORMAT_REMINDER = (
    "Your response did not contain an action. Reply in this format:\n"
    "Thought:\n<your reasoning>\n\nAction:\n<one action>"
)

_NON_COMMAND_CHARS = re.compile(r"[^A-Za-z0-9, ]", flags=re.ASCII)
_SPACES = re.compile(r"\s+")


def text_after_last_action(turn: str) -> str | None:
    """Returns the text after the last ``Action:`` (stripped), or None when the turn has no marker."""
    if not isinstance(turn, str):
        raise TypeError(f"an agent turn must be a str, got {type(turn).__name__}")
    position = turn.rfind(ACTION_MARKER)
    if position < 0:
        return None
    return turn[position + len(ACTION_MARKER) :].strip()


def first_line(text: str) -> str:
    """The first non-empty line of ``text`` ("" if none)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def sanitize_command(text: str) -> str:
    """Keeps only ``[A-Za-z0-9, ]`` (as the original clients do), collapses spaces and lower-cases."""
    cleaned = _NON_COMMAND_CHARS.sub(" ", text[:MAX_ACTION_CHARS])
    return _SPACES.sub(" ", cleaned).strip().lower()


def parse_single_line_action(turn: str) -> str | None:
    """The sanitized one-line action of a ReAct turn, or None when the turn has no ``Action:`` marker."""
    after = text_after_last_action(turn)
    if after is None:
        return None
    return sanitize_command(first_line(after))
