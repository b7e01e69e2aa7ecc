"""Turning the agent's ReAct turn text into one BabyAI action string.

Extraction: the action is the first non-empty line after the last ``Action:`` (case-insensitive; a bare
action string without the marker is taken as is, which is what AgentGym clients send). It is lower-cased
and reduced to ``[a-z0-9, ]`` with whitespace collapsed, as the original does, then trimmed of commas.

Matching against the available actions:

- ``"exact"``: the sanitized text must equal one available action string.
- ``"closest"``: the text is first normalized (``pick up`` -> ``pickup``, ``goto`` -> ``go to``, the articles
  ``the``/``a``/``an`` dropped, a missing trailing index read as ``1``) and taken if it then equals an
  available action. Otherwise the candidates are the available actions that contain every colour,
  object type, door state and number the text mentions; the one with the highest
  ``difflib.SequenceMatcher`` ratio wins (earlier in the list on ties) if that ratio is at least
  ``CLOSEST_THRESHOLD``; below it the action is invalid.
"""

from __future__ import annotations

import difflib
import re
from typing import Sequence

MAX_ACTION_CHARS = 120  # sanitized actions longer than this are rejected without matching
CLOSEST_THRESHOLD = 0.7
MATCHING_MODES = ("exact", "closest")

_MARKER = re.compile(r"action\s*:", re.IGNORECASE)
_NOT_ALLOWED = re.compile(r"[^a-z0-9, ]+")
_SPACES = re.compile(r"\s+")
_KEY_TOKENS = frozenset(
    "red green blue purple yellow grey ball box key door goal open closed locked".split()
)
_ARTICLES = frozenset(("the", "a", "an"))


class ActionMatchingError(ValueError):
    """Raised for an unknown ``action_matching`` mode."""


def check_matching_mode(mode: str) -> str:
    """Returns ``mode`` or raises a clear error."""
    if mode not in MATCHING_MODES:
        raise ActionMatchingError(f"unknown action_matching {mode!r}; use one of {MATCHING_MODES}")
    return mode


def extract_action(turn_text: str) -> str:
    """The sanitized action line of a ReAct turn (may be empty)."""
    if not isinstance(turn_text, str):
        raise TypeError(f"the agent's turn must be a str, got {type(turn_text).__name__}")
    markers = list(_MARKER.finditer(turn_text))
    region = turn_text[markers[-1].end():] if markers else turn_text
    line = next((part for part in region.splitlines() if part.strip()), "")
    return sanitize(line)


def sanitize(text: str) -> str:
    """Lower-case, keep only ``[a-z0-9, ]``, collapse whitespace, trim spaces and commas."""
    text = _NOT_ALLOWED.sub("", _SPACES.sub(" ", text.lower()))
    return _SPACES.sub(" ", text).strip(" ,")


def normalize(action: str) -> str:
    """The lenient form used by ``closest`` matching."""
    text = re.sub(r"\bpick up\b", "pickup", action)
    text = re.sub(r"\bgoto\b", "go to", text)
    return " ".join(token for token in text.split() if token not in _ARTICLES)


def match_action(action: str, available: Sequence[str], mode: str) -> str | None:
    """The available action that ``action`` (already sanitized) selects under ``mode``, or None."""
    if not action or len(action) > MAX_ACTION_CHARS:
        return None
    if action in available:
        return action
    if mode == "exact":
        return None
    text = normalize(action)
    for candidate in (text, f"{text} 1"):
        if candidate in available:
            return candidate
    required = {token for token in text.split() if token in _KEY_TOKENS or token.isdigit()}
    best, best_ratio = None, CLOSEST_THRESHOLD
    for candidate in available:
        if not required.issubset(candidate.split()):
            continue
        ratio = difflib.SequenceMatcher(None, text, candidate).ratio()
        if ratio > best_ratio or (best is None and ratio == best_ratio):
            best, best_ratio = candidate, ratio
    return best
