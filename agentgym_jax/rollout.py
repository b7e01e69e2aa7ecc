"""The multi-turn rollout: the sampler and the environment pool, in lock-step rounds or continuously.

Each round batches every active episode through the sampler (extending its KV cache with only the new tokens),
sends the decoded actions to the worker pool, renders the returned observations with the chat template and queues
them (loss mask 0) for the next round. The token ids the sampler produced are the ids trained on: nothing is
decoded and re-encoded. Each episode records why it ended: ``done`` (the environment finished it), ``horizon``
(turn cap), ``budget`` (token budget or KV cache full) or ``env_error``. Per-episode turns:
:mod:`agentgym_jax.episode_turns`; the continuous loop: :mod:`agentgym_jax.continuous_rollout`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from agentgym_jax.chat import ChatTokenizer
from agentgym_jax.continuous_rollout import play_continuous
from agentgym_jax.episode_turns import EpisodeTurns
from agentgym_jax.errors import ConfigError
from agentgym_jax.rollout_types import END_REASONS, RolloutConfig, RolloutStats, Trajectory
from agentgym_jax.sampling import Sampler
from agentgym_jax.shared_prompts import prefill_shared_prompts

__all__ = ["END_REASONS", "RolloutConfig", "RolloutStats", "Trajectory", "run_rollout"]


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
    sampler row takes the next queued episode (:func:`continuous_rollout.play_continuous`); otherwise episodes
    play in lock-step rounds, ``config.max_rows`` at a time (all at once when 0). ``progress(round, active,
    finished)`` is called after each round.
    """
    config.validate()
    if horizon < 1:
        raise ConfigError(f"horizon must be >= 1, got {horizon}")
    trajectories = [Trajectory(task_id=t.task_id, group_id=int(g), subtask=t.subtask) for t, g in zip(tasks, group_ids)]
    episode_keys = _episode_keys(rng, episode_offset + np.arange(len(trajectories)))
    stats = RolloutStats()
    t0 = time.perf_counter()
    turns = EpisodeTurns(sampler, pool, chat, config, horizon, stats)
    if config.continuous:
        play_continuous(turns, trajectories, episode_keys, progress)
    else:
        wave = config.max_rows or len(trajectories)
        for start in range(0, len(trajectories), wave):
            _play_lockstep(turns, trajectories[start: start + wave], episode_keys[start: start + wave], progress)
    stats.host_s = time.perf_counter() - t0 - stats.sampling_s - stats.env_s
    return trajectories, stats


def _play_lockstep(turns: EpisodeTurns, trajectories: list[Trajectory], episode_keys: jax.Array,
                   progress: Callable[[int, int, int], None] | None) -> None:
    """Every episode takes its turn in the same round; a round waits for the slowest. Finished rows are dropped
    from the sampler batch when few remain; the samples of a task share one prefill of their prompt."""
    sampler = turns.sampler
    pending = {i: ids for i, ids in enumerate(turns.reset(trajectories)) if ids is not None}
    with turns.sampler_work():
        state, cached = prefill_shared_prompts(sampler, pending, len(trajectories))
    row_of = {index: index for index in range(len(trajectories))}  # trajectory -> sampler row
    for round_index in range(turns.horizon):
        active = [i for i in pending if not trajectories[i].end_reason and turns.fits(trajectories[i], pending[i])]
        if not active:
            break
        if turns.compacts(state, len(active)):
            with turns.sampler_work():
                state = sampler.select_rows(state, [row_of[i] for i in active])
            row_of = {i: row for row, i in enumerate(active)}
        state, _ = turns.play_round(state, trajectories, active, row_of, pending, cached, episode_keys)
        if progress is not None:
            finished = sum(1 for t in trajectories if t.end_reason)
            progress(round_index + 1, len(trajectories) - finished, finished)
    turns.finish(trajectories)


@jax.jit
def _episode_keys(rng: jax.Array, episodes: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, episodes)
