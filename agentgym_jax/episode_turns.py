"""One turn at a time, per episode: what both rollout loops do with an episode between sampler calls.

An episode opens from its environment reset (its first prompt rendered with the chat template), samples a turn
(recorded with its loss mask and log-probs), sends the action to the worker pool, and reads the answer into its
next prompt, or ends (``done``, ``horizon``, ``budget`` or ``env_error``)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from agentgym_jax.chat import ChatTokenizer
from agentgym_jax.rollout_types import (END_BUDGET, END_DONE, END_ENV_ERROR, END_HORIZON, RolloutConfig,
                                        RolloutStats, Trajectory, state_key)
from agentgym_jax.sampling import Sampler, SamplingParams, StopReason


class EpisodeTurns:
    """What both loops do per episode: open it from its reset, sample turns, apply the environment's answers."""

    def __init__(self, sampler: Sampler, pool: Any, chat: ChatTokenizer, config: RolloutConfig, horizon: int,
                 stats: RolloutStats):
        self.sampler, self.pool, self.chat, self.config, self.horizon, self.stats = (sampler, pool, chat, config,
                                                                                    horizon, stats)
        prefix = config.response_prefix
        self.prefix_ids = [int(i) for i in chat.encode_in_turn(prefix)] if prefix else []

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

    @contextlib.contextmanager
    def sampler_work(self) -> Iterator[None]:
        """Counts the block's time as sampler time (``stats.sampling_s``): generate calls, and the prefills, forks
        and row moves of shared prompts and compaction, which would otherwise count as host work."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stats.sampling_s += time.perf_counter() - t0

    def generate(self, state: Any, rows: list[list[int] | None], params: list[SamplingParams],
                 keys: jax.Array, turns: np.ndarray, stop_after: int = 0) -> tuple[Any, Any]:
        """One sampler call; row ``r`` draws from ``keys[r]`` folded with its episode's turn ``turns[r]``."""
        with self.sampler_work():
            state, result = self.sampler.generate(state, rows, keys[0], params, row_keys=turn_keys(keys, turns),
                                                  stop_after=stop_after)
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


def _success(outcome: Any) -> bool:
    """The env's own verdict (``info["success"]``); an env that gives none passes only with the full reward."""
    info = outcome.info or {}
    if "success" in info:
        return bool(info["success"])
    return outcome.reward >= 1.0


@jax.jit
def turn_keys(episode_keys: jax.Array, turns: jax.Array) -> jax.Array:
    """Each row's key for its episode's turn ``turns[r]``: a sample depends on its episode and turn only."""
    return jax.vmap(jax.random.fold_in)(episode_keys, turns)
