"""The multi-turn rollout: the sampler and the environment pool in lock-step rounds.

Each round batches every active episode through the sampler (extending its KV cache with only the new tokens),
sends the decoded actions to the worker pool, renders the returned observations with the chat template and queues
them (loss mask 0) for the next round. The token ids the sampler produced are the ids trained on: nothing is
decoded and re-encoded. Each episode records why it ended: ``done`` (the environment finished it), ``horizon``
(turn cap), ``budget`` (token budget or KV cache full) or ``env_error``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from agentgym_jax.chat import ChatTokenizer
from agentgym_jax.errors import ConfigError
from agentgym_jax.sampling import Sampler, SamplingParams, StopReason
from agentgym_jax.shared_prompts import SharedOpening, prefill_shared_prompts

END_DONE, END_HORIZON, END_BUDGET, END_ENV_ERROR = "done", "horizon", "budget", "env_error"
END_REASONS = (END_DONE, END_HORIZON, END_BUDGET, END_ENV_ERROR)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Limits and prompt layout of a rollout."""

    max_turn_tokens: int = 64  # generated tokens per agent turn
    max_trajectory_tokens: int = 2048  # whole sequence: prompt, observations and actions
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    system_prompt: str | None = None  # None: the chat template's default
    canned_reply: str = ""  # the original answers the instruction with a canned assistant turn; "" = none
    # Text that opens every agent turn (e.g. "Action:\n"): template glue the model continues from, never trained
    # on (loss mask 0), part of the action the environment sees and of the recorded conversation.
    response_prefix: str = ""
    compact_below: float = 0.5  # drop finished rows from the sampler batch when active/batch falls below this
    # Sampler rows: 0 = every episode at once. Lock-step rounds play max_rows episodes at a time, a round waiting
    # for the slowest; continuous=True refills a finished episode's row with the next queued episode instead.
    max_rows: int = 0
    continuous: bool = False
    # continuous only: the rows' two halves take turns, one sampling while the environments step the other's
    # actions (_play_continuous); for environments whose steps take about as long as a sampler call
    async_env_steps: bool = False
    # continuous only: a sampler call returns once this share of its rows finished their turn; those take their
    # environment step and next turn (or a queued episode) while the others go on decoding. 1: calls run until
    # every row has finished its turn.
    refill_after: float = 0.5

    def validate(self) -> None:
        if self.max_turn_tokens < 1:
            raise ConfigError(f"rollout.max_turn_tokens must be >= 1, got {self.max_turn_tokens}")
        if self.max_trajectory_tokens <= self.max_turn_tokens:
            raise ConfigError("rollout.max_trajectory_tokens must exceed rollout.max_turn_tokens")
        SamplingParams(self.temperature, self.top_p, self.top_k, self.max_turn_tokens).validate()
        if self.max_rows < 0:
            raise ConfigError(f"rollout.max_rows must be >= 0 (0: every episode at once), got {self.max_rows}")
        if not 0 < self.refill_after <= 1:
            raise ConfigError(f"rollout.refill_after must be in (0, 1] (a share of a call's rows), got "
                              f"{self.refill_after}")
        if self.async_env_steps and not self.continuous:
            raise ConfigError("rollout.async_env_steps needs rollout.continuous=True (lock-step rounds wait for "
                              "every episode's answer anyway)")


@dataclasses.dataclass
class Trajectory:
    """One episode as token ids with per-token loss mask and behaviour log-probs."""

    task_id: int
    group_id: int
    subtask: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)  # 1 on agent-sampled tokens
    logprobs: list[float] = dataclasses.field(default_factory=list)  # sampler log-prob (0 off the mask)
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)  # readable conversation
    score: float = 0.0
    success: bool = False
    turns: int = 0
    end_reason: str = ""
    error: str | None = None
    episode_id: int = -1
    judged_actions: int = 0  # turns whose info said whether the environment understood the action
    valid_actions: int = 0  # of those, turns whose action the environment understood
    turn_ids: list[int] = dataclasses.field(default_factory=list)  # per token: its agent turn, -1 elsewhere
    step_rewards: list[float] = dataclasses.field(default_factory=list)  # per turn: the score it added
    state_keys: list[str] = dataclasses.field(default_factory=list)  # per turn: the state it acted in

    def append(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None, turn: int = -1) -> None:
        self.tokens.extend(int(i) for i in ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(list(logprobs) if logprobs is not None else [0.0] * len(ids))
        self.turn_ids.extend([turn] * len(ids))

    @property
    def num_agent_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def record_action_validity(self, info: dict[str, Any] | None) -> None:
        """Counts ``info["action_valid"]`` when the environment reports it (None: it did not judge)."""
        valid = (info or {}).get("action_valid")
        if valid is not None:
            self.judged_actions += 1
            self.valid_actions += int(bool(valid))


@dataclasses.dataclass
class RolloutStats:
    """Timing and counts of one rollout."""

    sampling_s: float = 0.0
    env_s: float = 0.0
    host_s: float = 0.0
    generated_tokens: int = 0
    env_steps: int = 0
    rounds: int = 0


def state_key(info: dict[str, Any] | None, observation: str) -> str:
    """The environment state an agent turn acts in: the env's ``info["state_key"]``, else the observation text."""
    key = (info or {}).get("state_key")
    return str(key) if key is not None else "observation:" + observation


def _success(outcome: Any) -> bool:
    """The env's own verdict (``info["success"]``); an env that gives none passes only with the full reward."""
    info = outcome.info or {}
    if "success" in info:
        return bool(info["success"])
    return outcome.reward >= 1.0


def run_rollout(
    sampler: Sampler,
    pool: Any,
    chat: ChatTokenizer,
    tasks: Sequence[Any],
    group_ids: Sequence[int],
    config: RolloutConfig,
    horizon: int,
    rng: jax.Array,
    progress: Callable[[int, int, int], None] | None = None,
    episode_offset: int = 0,
) -> tuple[list[Trajectory], RolloutStats]:
    """Plays one episode per entry of ``tasks`` (``Task`` objects; repeat a task for group sampling).

    Episode ``i`` samples from ``rng`` folded with ``episode_offset + i`` and its turn number, so an episode's
    tokens do not depend on the sampler row, batch, loop or process that plays it (``episode_offset``: the number
    of episodes of the same call played by earlier processes). With ``config.continuous`` a finished episode's
    sampler row takes the next queued episode (:func:`_play_continuous`); otherwise episodes play in lock-step
    rounds, ``config.max_rows`` at a time (all at once when 0). ``progress(round, active, finished)`` is called
    after each round.
    """
    config.validate()
    if horizon < 1:
        raise ConfigError(f"horizon must be >= 1, got {horizon}")
    trajectories = [Trajectory(task_id=t.task_id, group_id=int(g), subtask=t.subtask) for t, g in zip(tasks, group_ids)]
    episode_keys = _episode_keys(rng, episode_offset + np.arange(len(trajectories)))
    stats = RolloutStats()
    t0 = time.perf_counter()
    turns = _Turns(sampler, pool, chat, config, horizon, stats)
    if config.continuous:
        _play_continuous(turns, trajectories, episode_keys, progress)
    else:
        wave = config.max_rows or len(trajectories)
        for start in range(0, len(trajectories), wave):
            _play_lockstep(turns, trajectories[start: start + wave], episode_keys[start: start + wave], progress)
    stats.host_s = time.perf_counter() - t0 - stats.sampling_s - stats.env_s
    return trajectories, stats


class _Turns:
    """What both loops do per episode: open it from its reset, sample turns, apply the environment's answers."""

    def __init__(self, sampler: Sampler, pool: Any, chat: ChatTokenizer, config: RolloutConfig, horizon: int,
                 stats: RolloutStats):
        self.sampler, self.pool, self.chat, self.config, self.horizon, self.stats = (sampler, pool, chat, config,
                                                                                    horizon, stats)
        self.prefix_ids = [int(i) for i in chat.encode_in_turn(config.response_prefix)] if config.response_prefix else []

    def reset(self, trajectories: Sequence[Trajectory]) -> list[list[int] | None]:
        """Starts the episodes; each one's first prompt ids (None where the reset failed: it has ended)."""
        t0 = time.perf_counter()
        starts = self.pool.reset([t.task_id for t in trajectories])
        self.stats.env_s += time.perf_counter() - t0
        config, instruction = self.config, self.pool.instruction
        prompts: list[list[int] | None] = []
        for trajectory, start in zip(trajectories, starts):
            trajectory.episode_id = start.episode_id
            if start.error:
                trajectory.end_reason, trajectory.error = END_ENV_ERROR, start.error
                prompts.append(None)
                continue
            messages = [] if config.system_prompt is None else [{"role": "system", "content": config.system_prompt}]
            if config.canned_reply:
                messages += [{"role": "user", "content": instruction},
                             {"role": "assistant", "content": config.canned_reply},
                             {"role": "user", "content": start.observation}]
            else:
                messages += [{"role": "user", "content": f"{instruction}\n\n{start.observation}"}]
            trajectory.messages = messages
            trajectory.state_keys.append(state_key(start.info, start.observation))
            prompts.append([int(i) for i in self.chat.render(messages, add_generation_prompt=True).ids]
                           + self.prefix_ids)
        return prompts

    def fits(self, trajectory: Trajectory, prompt: Sequence[int]) -> bool:
        """Whether the next turn fits the token budget (its new tokens plus one generated token); ends it if not."""
        if len(trajectory.tokens) + len(prompt) + 1 > self.config.max_trajectory_tokens:
            trajectory.end_reason = END_BUDGET
            return False
        return True

    def params(self, trajectory: Trajectory, prompt: Sequence[int]) -> SamplingParams:
        room = self.config.max_trajectory_tokens - len(trajectory.tokens) - len(prompt)
        c = self.config
        return SamplingParams(c.temperature, c.top_p, c.top_k, min(c.max_turn_tokens, room))

    def generate(self, state: Any, rows: list[list[int] | None], params: list[SamplingParams],
                 keys: jax.Array, turns: np.ndarray, stop_after: int = 0) -> tuple[Any, Any]:
        """One sampler call; row ``r`` draws from ``keys[r]`` folded with its episode's turn ``turns[r]``."""
        t0 = time.perf_counter()
        state, result = self.sampler.generate(state, rows, keys[0], params, row_keys=_turn_keys(keys, turns),
                                              stop_after=stop_after)
        self.stats.sampling_s += time.perf_counter() - t0
        self.stats.rounds += 1
        return state, result

    def record(self, trajectory: Trajectory, prompt: Sequence[int], sampled: list[int], logprobs: list[float],
               reason: StopReason) -> str | None:
        """Appends a turn's prompt and sampled tokens; its action text (None: the cache was full, it ended)."""
        trajectory.append(prompt, 0)
        trajectory.append(sampled, 1, logprobs, turn=trajectory.turns)
        self.stats.generated_tokens += len(sampled)
        trajectory.turns += 1
        if reason == StopReason.CACHE_FULL and not sampled:
            trajectory.end_reason = END_BUDGET
            return None
        text = self.config.response_prefix + self.chat.decode_assistant(sampled)
        trajectory.messages.append({"role": "assistant", "content": text})
        return text

    def step(self, actions: dict[int, str]) -> dict[int, Any]:
        t0 = time.perf_counter()
        outcomes = self.pool.step(actions) if actions else {}
        self.stats.env_s += time.perf_counter() - t0
        self.stats.env_steps += len(outcomes)
        return outcomes

    def answer(self, trajectory: Trajectory, outcome: Any, sampled: list[int]) -> list[int] | None:
        """Records the environment's answer to the last turn; the next turn's prompt ids, or None when the
        episode ended (done, env error, or its horizon reached)."""
        if outcome.error:
            trajectory.end_reason, trajectory.error = END_ENV_ERROR, outcome.error
            trajectory.step_rewards.append(-trajectory.score)  # the outcome falls back to 0
            trajectory.score, trajectory.success = 0.0, False
            return None
        trajectory.step_rewards.append(float(outcome.reward) - trajectory.score)
        trajectory.score, trajectory.success = float(outcome.reward), _success(outcome)
        trajectory.record_action_validity(outcome.info)
        if outcome.done:
            trajectory.end_reason = END_DONE
            return None
        if trajectory.turns >= self.horizon:
            trajectory.end_reason = END_HORIZON
            return None
        closing = self.chat.assistant_turn(sampled, include_generation_prompt=False)
        observation = {"role": "user", "content": outcome.observation}
        turn = self.chat.render_turn(list(trajectory.messages), observation, add_generation_prompt=True)
        trajectory.messages.append(observation)
        trajectory.state_keys.append(state_key(outcome.info, outcome.observation))
        return [int(t) for t in closing.ids[len(sampled):]] + [int(t) for t in turn.ids] + self.prefix_ids

    def sample_turn(self, state: Any, trajectories: Sequence[Trajectory], active: Sequence[int],
                    row_of: dict[int, int], pending: dict[int, list[int]], cached: dict[int, int],
                    episode_keys: jax.Array, decoding: dict[int, list[int]] | None = None, stop_after: int = 0,
                    ) -> tuple[Any, list[int], dict[int, str], dict[int, list[int]]]:
        """One sampler call for the episodes in ``active`` (trajectory indices, each in its sampler row), which
        records their turns. ``cached[i]``: leading ids of ``pending[i]`` already in the row. ``decoding``: the
        episodes mid-turn (a call with ``stop_after`` returned before they finished), each with its turn's prompt;
        they go on decoding, and those still unfinished after this call stay in it. Returns the state, the
        episodes that ended (cache full), the actions for the environment by episode id, and the sampled ids of
        each episode that finished its turn."""
        c = self.config
        decoding = {} if decoding is None else decoding
        rows: list[list[int] | None] = [None] * state.batch_size  # None: a row mid-turn goes on
        params = [SamplingParams(c.temperature, c.top_p, c.top_k, 1)] * state.batch_size
        episode_of_row = np.zeros((state.batch_size,), np.int32)
        for i in active:
            rows[row_of[i]] = pending[i][cached.pop(i, 0):]  # a shared prompt's prefix is in the cache already
            params[row_of[i]] = self.params(trajectories[i], pending[i])
            episode_of_row[row_of[i]] = i
        state, result = self.generate(state, rows, params, episode_keys[episode_of_row],
                                      np.array([trajectories[i].turns for i in episode_of_row], np.int32),
                                      stop_after)
        prompts = {**{i: pending.pop(i) for i in active}, **decoding}
        ended, actions, sampled = [], {}, {}
        for i, prompt in prompts.items():
            row = row_of[i]
            if result.stop_reasons[row] == StopReason.RUNNING:
                decoding[i] = prompt
                continue
            decoding.pop(i, None)
            sampled[i] = result.tokens[row]
            action = self.record(trajectories[i], prompt, sampled[i], result.logprobs[row],
                                 result.stop_reasons[row])
            if action is None:
                ended.append(i)
            else:
                actions[trajectories[i].episode_id] = action
        return state, ended, actions, sampled

    def apply_answers(self, trajectories: Sequence[Trajectory], outcomes: dict[int, Any],
                      sampled: dict[int, list[int]], pending: dict[int, list[int]]) -> list[int]:
        """Reads the environment's answers (by episode id) into the episodes; puts each continuing episode's next
        prompt in ``pending``; returns the episodes that ended."""
        by_episode = {trajectories[i].episode_id: i for i in sampled}
        ended = []
        for episode_id, outcome in outcomes.items():
            i = by_episode[episode_id]
            following = self.answer(trajectories[i], outcome, sampled[i])
            if following is None:
                ended.append(i)
            else:
                pending[i] = following
        return ended

    def play_round(self, state: Any, trajectories: Sequence[Trajectory], active: Sequence[int],
                   row_of: dict[int, int], pending: dict[int, list[int]], cached: dict[int, int],
                   episode_keys: jax.Array) -> tuple[Any, list[int]]:
        """One whole turn for each episode in ``active``: sample, step the environments, read their answers.
        Returns the state and the episodes that ended in this turn."""
        state, ended, actions, sampled = self.sample_turn(state, trajectories, active, row_of, pending, cached,
                                                          episode_keys)
        return state, ended + self.apply_answers(trajectories, self.step(actions), sampled, pending)

    def compacts(self, state: Any, playing: int) -> bool:
        """Whether a batch with ``playing`` episodes left should drop the rows of the others: they fill less than
        ``config.compact_below`` of it and fit a smaller batch bucket."""
        return (0 < playing < self.config.compact_below * state.batch_size
                and self.sampler.batch_bucket(playing) < state.batch_size)

    def finish(self, trajectories: Sequence[Trajectory]) -> None:
        for trajectory in trajectories:
            if not trajectory.end_reason:
                trajectory.end_reason = END_HORIZON if trajectory.turns >= self.horizon else END_BUDGET
        self.pool.close_episodes([t.episode_id for t in trajectories if t.episode_id >= 0])


def _play_lockstep(turns: _Turns, trajectories: list[Trajectory], episode_keys: jax.Array,
                   progress: Callable[[int, int, int], None] | None) -> None:
    """Every episode takes its turn in the same round; a round waits for the slowest. Finished rows are dropped
    from the sampler batch when few remain; the samples of a task share one prefill of their prompt."""
    sampler = turns.sampler
    pending = {i: ids for i, ids in enumerate(turns.reset(trajectories)) if ids is not None}
    state, cached = prefill_shared_prompts(sampler, pending, len(trajectories))
    row_of = {index: index for index in range(len(trajectories))}  # trajectory -> sampler row
    for round_index in range(turns.horizon):
        active = [i for i in pending if not trajectories[i].end_reason and turns.fits(trajectories[i], pending[i])]
        if not active:
            break
        if turns.compacts(state, len(active)):
            state = sampler.select_rows(state, [row_of[i] for i in active])
            row_of = {i: row for row, i in enumerate(active)}
        state, _ = turns.play_round(state, trajectories, active, row_of, pending, cached, episode_keys)
        if progress is not None:
            finished = sum(1 for t in trajectories if t.end_reason)
            progress(round_index + 1, len(trajectories) - finished, finished)
    turns.finish(trajectories)


def _play_continuous(turns: _Turns, trajectories: list[Trajectory], episode_keys: jax.Array,
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
        opening.find_opening(sampler, [ids for ids in prompts if ids is not None])  # one half may hold one task
        for h, opened in enumerate(opened_by_half):
            if opened:
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


def _compact(turns: _Turns, state: Any, row_of: dict[int, int], half: int, size: int) -> Any:
    """Half ``half``'s sampler state with only the rows of its playing episodes, in a smaller batch bucket when
    they fit one (as lock-step rounds drop finished rows; ``config.compact_below``); ``row_of`` is updated."""
    playing = sorted((row % size, i) for i, row in row_of.items() if row // size == half)
    if not turns.compacts(state, len(playing)):
        return state
    state = turns.sampler.select_rows(state, [row for row, _ in playing])
    for local, (_, i) in enumerate(playing):
        row_of[i] = half * size + local
    return state


@jax.jit
def _episode_keys(rng: jax.Array, episodes: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, episodes)


@jax.jit
def _turn_keys(episode_keys: jax.Array, turns: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in)(episode_keys, turns)
