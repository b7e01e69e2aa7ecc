"""Prompt tokens that many episodes share, written into the KV cache once and copied into each episode's row.

Two sharers: every episode's opening (system prompt and instruction, the same for a whole rollout) and the samples
of one task (the same whole first prompt). Lock-step rounds fork both when the rollout starts
(:func:`prefill_shared_prompts`); continuous episodes copy the opening into each row they refill
(:class:`SharedOpening`).
"""

from __future__ import annotations

from typing import Any, Sequence

from agentgym_jax.sampling import Sampler


class SharedOpening:
    """The opening every episode's first prompt shares (system prompt, instruction), prefilled once into a
    one-row cache and copied into each row a new episode takes, so only the rest of its prompt is computed; the
    rows admitted together with the same whole prompt (the samples of one task) compute that rest once. A prompt
    whose later rows are admitted in later rounds (``keep``) is also kept in a one-row cache until its last row
    takes it, so the samples of a task compute it once however the rows free up (one or two such one-row caches at a
    time when tasks queue sample after sample, as the trainer's do; at most ``MAX_KEPT``)."""

    MIN_TOKENS = 16  # a shorter shared opening is not worth a copy
    MAX_KEPT = 4  # one-row caches of whole prompts kept at most; the oldest goes first

    def __init__(self) -> None:
        self.ids: list[int] | None = None
        self.state: Any = None
        self.kept: dict[tuple[int, ...], Any] = {}  # whole first prompt -> one-row cache of all but its last id

    def fill(self, sampler: Sampler, state: Any, rows: list[tuple[int, list[int]]],
             keep: Sequence[bool] | None = None) -> tuple[Any, list[int]]:
        """Writes what it can share of the (emptied) ``rows``' prompts into them; how many ids of each prompt are
        in its row now (0 where nothing was shared). ``keep[r]``: rows admitted later will bring row r's prompt
        (the other samples of its task are still queued); a kept prompt is dropped when rows take it without
        ``keep``."""
        keep = list(keep) if keep is not None else [False] * len(rows)
        self.find_opening(sampler, [ids for _, ids in rows])
        cached = [0] * len(rows)
        for ids, source in self.kept.items():  # prompts computed in an earlier round
            hits = [index for index, (_, row_ids) in enumerate(rows) if tuple(row_ids) == ids]
            if hits:
                state = sampler.copy_row(source, 0, state, [rows[index][0] for index in hits])
                for index in hits:
                    cached[index] = len(ids) - 1
        n = len(self.ids or ())
        starts = [not cached[index] and bool(n) and len(ids) > n and ids[:n] == self.ids
                  for index, (_, ids) in enumerate(rows)]
        if any(starts):
            state = sampler.copy_row(self.state, 0, state, [row for (row, _), hit in zip(rows, starts) if hit])
        cached = [n if hit else c for hit, c in zip(starts, cached)]
        state, cached = _fork_same_prompts(sampler, state, rows, cached, keep)
        self._keep(sampler, state, rows, keep, cached)
        return state, cached

    def find_opening(self, sampler: Sampler, prompts: list[list[int]]) -> None:
        """Fixes the opening, once, from first prompts of several tasks (what the samples of one task share is
        their whole prompt, not the opening): prefills it into the one-row cache."""
        if self.ids is not None or len({tuple(ids) for ids in prompts}) < 2:
            return
        common = _shared_head(prompts)
        self.ids = prompts[0][:common] if common >= self.MIN_TOKENS else []
        if self.ids:
            self.state = sampler.prefill(sampler.new_state(1), [self.ids])

    def _keep(self, sampler: Sampler, state: Any, rows: list[tuple[int, list[int]]], keep: list[bool],
              cached: list[int]) -> None:
        """Keeps a one-row copy of each whole prompt to keep (now cached but for its last id); drops the kept
        prompts these rows took last (``keep`` false). Prompts these rows do not bring stay (another half's)."""
        opening = len(self.ids or ())
        for (row, ids), flag, n in zip(rows, keep, cached):
            key = tuple(ids)
            if not flag:
                self.kept.pop(key, None)
            elif key not in self.kept and n == len(ids) - 1 > opening:  # more than the opening to share
                self.kept[key] = sampler.select_rows(state, [row])
                while len(self.kept) > self.MAX_KEPT:  # samples of a task whose prompts differ, tasks interleaved
                    self.kept.pop(next(iter(self.kept)))


def _fork_same_prompts(sampler: Sampler, state: Any, rows: list[tuple[int, list[int]]],
                       cached: list[int], keep: list[bool]) -> tuple[Any, list[int]]:
    """Rows with the same whole prompt, and rows whose prompt is kept for later rows (``keep``): the rest of it
    (past ``cached``, all but its last id) is prefilled in the first of them and copied into the others. Returns
    the state and the ids now cached per row."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (_, ids) in enumerate(rows):
        if cached[index] < len(ids) - 1:
            groups.setdefault(tuple(ids), []).append(index)
    groups = {ids: members for ids, members in groups.items()
              if (len(members) > 1 or any(keep[index] for index in members)) and len(ids) > 1}
    if not groups:
        return state, cached
    tokens: list[list[int] | None] = [None] * state.batch_size
    cached = list(cached)
    for ids, members in groups.items():
        tokens[rows[members[0]][0]] = list(ids[cached[members[0]]:-1])
        for index in members:
            cached[index] = len(ids) - 1
    state = sampler.prefill(state, tokens)
    for members in groups.values():  # each lead row copied into its group's other rows, in place
        if len(members) > 1:
            lead = sampler.select_rows(state, [rows[members[0]][0]])
            state = sampler.copy_row(lead, 0, state, [rows[index][0] for index in members[1:]])
    return state, cached


def _shared_head(prompts: list[list[int]]) -> int:
    """How many leading ids every prompt shares, leaving each at least one: the first generate call needs a new
    token to read logits from."""
    shortest = max(min(len(ids) for ids in prompts) - 1, 0)
    return next((n for n in range(shortest) if any(ids[n] != prompts[0][n] for ids in prompts)), shortest)


def prefill_shared_prompts(sampler: Sampler, pending: dict[int, list[int]],
                           episodes: int) -> tuple[Any, dict[int, int]]:
    """Writes shared prompt tokens into the cache once and forks them: the opening every episode shares (system
    prompt and instruction) once per rollout, then each distinct first prompt (the samples of one task) once per
    task, instead of once per episode.

    Returns the sampler state and, per episode, how many of its pending ids are already in its cache row (all but
    the last: the first ``generate`` call needs a new token to read logits from).
    """
    if not pending:
        return sampler.new_state(episodes), {}
    prompts = list(pending.values())
    common = _shared_head(prompts)
    distinct: dict[tuple[int, ...], int] = {}
    source = {i: distinct.setdefault(tuple(ids), len(distinct)) for i, ids in pending.items()}
    if len(distinct) == len(pending) and common < 2 * len(prompts[0]) // 5:
        return sampler.new_state(episodes), {}  # too little shared to pay for the extra programs
    state = sampler.new_state(1)
    state = sampler.prefill(state, [prompts[0][:common]])
    state = sampler.select_rows(state, [0] * len(distinct))
    state = sampler.prefill(state, [list(ids[common:-1]) for ids in distinct])
    state = sampler.select_rows(state, [source.get(i, 0) for i in range(episodes)])
    return state, {i: len(ids) - 1 for i, ids in pending.items()}
