"""The continuous rollout loop: a finished episode's sampler row takes the next queued episode at once, and a
sampler call returns once enough of its rows finished their turn (:func:`play_continuous`)."""

from __future__ import annotations

import collections
import concurrent.futures
import math
import time
from typing import Any, Callable

import jax

from agentgym_jax.episode_turns import EpisodeTurns
from agentgym_jax.rollout_types import Trajectory
from agentgym_jax.shared_prompts import SharedOpening


def play_continuous(turns: EpisodeTurns, trajectories: list[Trajectory], episode_keys: jax.Array,
                     progress: Callable[[int, int, int], None] | None) -> None:
    """Episodes queue for ``config.max_rows`` sampler rows (all at once when 0): each round, free rows take the
    next queued episodes (reset, and their prompt written into the row's emptied cache), then the episodes in
    rows take a turn. A finished episode frees its row (and its environment episode) at once, so no row waits
    for the slowest episode of a round. Within a round no row waits for the slowest turn either: a sampler call
    returns once ``config.refill_after`` of its rows finished their turn; the others go on decoding in the next
    call, beside the rows that took their next turn or a queued episode meanwhile.

    With ``config.async_env_steps`` the rows form two halves (the first and the second half of the rows, so that
    each half's episodes are spread over the pool's workers), each its own sampler batch, that take turns: while
    the environments step one half's actions (in a background thread; the pool serves one call at a time), the
    sampler generates for the other half. It pays where an environment step takes about as long as a half-batch
    sampler call (web pages, remote servers); with millisecond environments it only halves the sampler batch."""
    sampler = turns.sampler
    rows = min(turns.config.max_rows or len(trajectories), len(trajectories))
    halves = 2 if turns.config.async_env_steps and rows > 1 else 1
    size = -(-rows // halves)  # row r is row r % size of states[r // size]: each half's episodes span the workers
    with turns.sampler_work():
        states = [sampler.new_state(min(size, rows - h * size)) for h in range(halves)]
    queue = collections.deque(range(len(trajectories)))
    free_rows = list(range(rows))
    row_of: dict[int, int] = {}  # playing episode -> its row
    pending: dict[int, list[int]] = {}
    decoding: dict[int, list[int]] = {}  # episodes mid-turn (their call returned early) -> their turn's prompt
    opening = SharedOpening()
    cached: dict[int, int] = {}  # episode -> leading ids of its pending prompt already in its row
    executor = concurrent.futures.ThreadPoolExecutor(1, "env-steps") if halves == 2 else None
    in_flight: tuple[concurrent.futures.Future, dict[int, list[int]]] | None = None  # env steps running now

    def settle() -> list[int]:
        """Waits for the environment steps in flight and reads their answers; the episodes that ended."""
        nonlocal in_flight
        if in_flight is None:
            return []
        (future, sampled), in_flight = in_flight, None
        t0 = time.perf_counter()
        outcomes = future.result()
        turns.stats.env_s += time.perf_counter() - t0  # the time the loop waited, not the overlapped time
        turns.stats.env_steps += len(outcomes)
        return turns.apply_answers(trajectories, outcomes, sampled, pending)

    def release(ended: list[int]) -> None:  # frees each row for the next queued episode, and its env episode
        for i in ended:
            free_rows.append(row_of.pop(i))
            pending.pop(i, None)
        turns.finish([trajectories[i] for i in ended])

    def admit() -> None:
        admitted = [(queue.popleft(), free_rows.pop(0)) for _ in range(min(len(queue), len(free_rows)))]
        prompts = turns.reset([trajectories[i] for i, _ in admitted])
        free_rows.extend(row for (i, row), ids in zip(admitted, prompts) if ids is None)
        turns.finish([trajectories[i] for (i, _), ids in zip(admitted, prompts) if ids is None])
        task = lambda i: (trajectories[i].task_id, trajectories[i].subtask)
        opened_by_half = [[(i, row, ids) for (i, row), ids in zip(admitted, prompts)
                           if ids is not None and row // size == h] for h in range(halves)]
        with turns.sampler_work():
            opening.find_opening(sampler, [ids for ids in prompts if ids is not None])  # a half may hold one task
            for h, opened in enumerate(opened_by_half):
                if not opened:
                    continue
                states[h] = sampler.clear_rows(states[h], [row % size for _, row, _ in opened])
                # a task's prompt is kept while its samples still queue, or open in the other half after this one
                waiting = {task(j) for j in queue} | {task(i) for rest in opened_by_half[h + 1:] for i, _, _ in rest}
                later = [task(i) in waiting for i, _, _ in opened]
                states[h], shared = opening.fill(sampler, states[h], [(row % size, ids) for _, row, ids in opened],
                                                 keep=later)
                for (i, row, ids), length in zip(opened, shared):
                    row_of[i], pending[i], cached[i] = row, ids, length

    round_index, half = 0, 0
    try:
        while queue or row_of:
            if queue and free_rows:
                release(settle())  # resets use the pool: the steps in flight finish first
                admit()
            waiting = set(in_flight[1]) if in_flight else set()
            ready = [i for i in row_of if i not in waiting]  # starting a turn or mid-turn
            if halves == 2 and not any(row_of[i] // size == half for i in ready):
                half = 1 - half  # this half has no episode ready: the other one samples
            ready = [i for i in ready if row_of[i] // size == half]
            ended = [i for i in ready if i not in decoding and not turns.fits(trajectories[i], pending[i])]
            active = [i for i in ready if i not in ended and i not in decoding]
            going_on = {i: decoding.pop(i) for i in ready if i in decoding}
            actions: dict[int, str] = {}
            if active or going_on:
                local = {i: row_of[i] % size for i in active + list(going_on)}
                refill_after = turns.config.refill_after  # 1: to the end of every turn, each last id fed
                stop_after = math.ceil(refill_after * (len(active) + len(going_on))) if refill_after < 1 else 0
                states[half], finished_now, actions, sampled = turns.sample_turn(
                    states[half], trajectories, active, local, pending, cached, episode_keys, going_on, stop_after)
                decoding.update(going_on)  # those still mid-turn
                ended += finished_now
            ended += settle()  # the other half's answers, stepped while this half sampled
            release(ended)
            if actions and executor is not None:
                in_flight = (executor.submit(turns.pool.step, actions), sampled)
            elif actions:
                release(turns.apply_answers(trajectories, turns.step(actions), sampled, pending))
            if not queue:  # nothing left to admit: the rows of ended episodes only cost the calls their reads
                with turns.sampler_work():
                    for h in range(halves):
                        states[h] = _compact(turns, states[h], row_of, h, size)
            half = (half + 1) % halves
            round_index += 1
            if progress is not None:
                finished = sum(1 for t in trajectories if t.end_reason)
                progress(round_index, len(row_of), finished)
    finally:
        if executor is not None:
            executor.shutdown(wait=True)  # nothing else may use the pool while a step is in flight


def _compact(turns: EpisodeTurns, state: Any, row_of: dict[int, int], half: int, size: int) -> Any:
    """Half ``half``'s sampler state with only the rows of its playing episodes, in a smaller batch bucket when
    they fit one (as lock-step rounds drop finished rows; ``config.compact_below``); ``row_of`` is updated."""
    playing = sorted((row % size, i) for i, row in row_of.items() if row // size == half)
    if not turns.compacts(state, len(playing)):
        return state
    state = turns.sampler.select_rows(state, [row for row, _ in playing])
    for local, (_, i) in enumerate(playing):
        row_of[i] = half * size + local
    return state
