"""Turns a sampler call left unfinished, to resume in a later call exactly where they stopped.

``Sampler.generate(..., stop_after=n)`` returns once ``n`` rows finished their turn, so that a loop can hand those
rows their next prompt (their environment's answer, or a queued episode) while the other rows are still decoding.
A row still decoding keeps, in its ``SamplerState``, what the next call needs to go on as if never interrupted:
the token it drew last (not yet in its KV cache), how many it drew (the index its next draw folds into its key),
its last ids (stop sequences may span the two calls), its sampling rule and key, and the turn's ids so far.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class PartialTurn:
    """A row's turn, still decoding when its sampler call returned."""

    feed: int  # the last drawn id: the next call feeds it first
    tokens: tuple[int, ...]  # ids drawn so far in this turn
    logprobs: tuple[float, ...]
    recent: tuple[int, ...]  # the last drawn ids (-1 before the first), as the stop-sequence check reads them
    params: object  # the row's SamplingParams
    key: Any  # the row's PRNG key


def moved(partial: dict[int, PartialTurn], index: Sequence[int], keep: Sequence[bool]) -> dict[int, PartialTurn]:
    """Partial turns after rows are gathered (new row ``r`` is old row ``index[r]`` where ``keep[r]``)."""
    return {new: partial[old] for new, (old, kept) in enumerate(zip(index, keep)) if kept and old in partial}


def without(partial: dict[int, PartialTurn], rows: Sequence[int]) -> dict[int, PartialTurn]:
    """Partial turns of every row but ``rows`` (rows emptied or overwritten: their turn is gone)."""
    dropped = set(int(r) for r in rows)
    return {row: turn for row, turn in partial.items() if row not in dropped}
