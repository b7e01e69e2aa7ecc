"""The two rollout loops: lock-step rounds and continuous episodes (a finished episode's sampler row is refilled
with the next queued one, optionally with environment steps overlapping sampling) play the same episodes, token
for token, for a fixed seed."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import jax
import numpy as np
import pytest

from tests.test_trainer import tiny_config


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from agentgym_jax.trainer import Trainer
    from tests.tiny_models import save_tiny_chat_model

    root = tmp_path_factory.mktemp("loops")
    config = tiny_config(save_tiny_chat_model(root / "model"), root / "run")
    config.env.kwargs = dict(turns=5, stop_on_hit=True)  # episodes of 1 to 5 turns
    config.rollout.max_turn_tokens, config.rollout.max_trajectory_tokens = 4, 384
    # ids the random model draws often end a turn: turns of 1 to 4 tokens, so continuous calls return early
    config.rollout.stop_strings = ("X", "l", "ar", "R", "s", "e", "a", "o")
    trainer = Trainer(config)
    yield trainer
    trainer.close()


def _play(trainer, tasks, greedy, **rollout):
    rollout.setdefault("async_env_steps", False)
    rollout.setdefault("refill_after", 0.5)
    trainer.rollout_config = dataclasses.replace(trainer.rollout_config, **rollout)
    trajectories, stats = trainer.rollout(tasks, 4, 5, jax.random.PRNGKey(11), greedy=greedy)
    return trajectories, stats


@pytest.mark.parametrize("greedy", [True, False])
def test_continuous_episodes_play_the_lockstep_episodes(trainer, greedy, monkeypatch):
    tasks = trainer.train_tasks[:6]  # 24 episodes
    lockstep, lock_stats = _play(trainer, tasks, greedy, continuous=False, max_rows=0)
    continuous, cont_stats = _play(trainer, tasks, greedy, continuous=True, max_rows=8, refill_after=1.0)
    mid_turn = []  # rows still decoding when a call returned (refill_after < 1)
    real = trainer.sampler.generate

    def spy(*args, **kwargs):
        state, result = real(*args, **kwargs)
        mid_turn.append(len(state.partial))
        return state, result

    monkeypatch.setattr(trainer.sampler, "generate", spy)
    early, early_stats = _play(trainer, tasks, greedy, continuous=True, max_rows=8, refill_after=0.25)
    monkeypatch.undo()
    assert greedy or sum(mid_turn) > 0, mid_turn  # sampled turns of 1 to 4 tokens: some calls returned early
    waves, wave_stats = _play(trainer, tasks, greedy, continuous=False, max_rows=8)
    overlapped, async_stats = _play(trainer, tasks, greedy, continuous=True, max_rows=8, async_env_steps=True)
    turns = [t.turns for t in lockstep]
    if not greedy:  # (the random model's greedy reply never scores: every greedy episode takes 5 turns)
        assert min(turns) < max(turns), turns  # episodes of different lengths
    for other in (continuous, early, waves, overlapped):
        assert len(other) == len(lockstep)
        for mine, ref in zip(other, lockstep):
            assert (mine.task_id, mine.group_id, mine.turns, mine.end_reason) == (
                ref.task_id, ref.group_id, ref.turns, ref.end_reason)
            assert mine.tokens == ref.tokens and mine.loss_mask == ref.loss_mask and mine.turn_ids == ref.turn_ids
            assert mine.messages == ref.messages and mine.step_rewards == ref.step_rewards
            np.testing.assert_allclose(mine.logprobs, ref.logprobs, atol=1e-4)
    # 8 rows for 24 episodes: the continuous loop refills rows instead of playing waves of 8, each waiting for its
    # slowest episode
    assert (cont_stats.generated_tokens == wave_stats.generated_tokens == lock_stats.generated_tokens
            == async_stats.generated_tokens == early_stats.generated_tokens)
    assert async_stats.env_steps == cont_stats.env_steps
    assert cont_stats.rounds <= wave_stats.rounds
    if not greedy:
        assert cont_stats.rounds < wave_stats.rounds, (cont_stats.rounds, wave_stats.rounds)


def test_continuous_rows_bound_the_sampler_batch(trainer, monkeypatch):
    sizes = []
    real = trainer.sampler.generate

    def spy(state, rows, *args, **kwargs):
        sizes.append(state.batch_size)
        return real(state, rows, *args, **kwargs)

    copies = []
    real_copy = trainer.sampler.copy_row

    def copy_spy(source, row, state, rows):
        copies.append((id(source), len(rows)))
        return real_copy(source, row, state, rows)

    monkeypatch.setattr(trainer.sampler, "generate", spy)
    monkeypatch.setattr(trainer.sampler, "copy_row", copy_spy)
    _play(trainer, trainer.train_tasks[:6], True, continuous=True, max_rows=8)
    assert sizes and set(sizes) == {8}
    by_source = {}
    for source, rows in copies:  # the opening's one-row cache, or a task's prompt forked into its other samples
        by_source[source] = by_source.get(source, 0) + rows
    assert max(by_source.values()) == 24  # every episode's row got the shared opening from the one prefilled copy


def test_continuous_tail_drops_the_rows_of_ended_episodes(trainer, monkeypatch):
    calls = []  # (batch of the call, rows given tokens)
    real = trainer.sampler.generate

    def spy(state, rows, *args, **kwargs):
        calls.append((state.batch_size, sum(1 for ids in rows if ids)))
        return real(state, rows, *args, **kwargs)

    monkeypatch.setattr(trainer.sampler, "generate", spy)
    played, _ = _play(trainer, trainer.train_tasks[:6], False, continuous=True, max_rows=8)
    turns = [t.turns for t in played]
    assert min(turns) < max(turns), turns
    assert calls[0] == (8, 8)
    # once no episode queues and fewer than half the rows play, a call holds only the playing episodes, in the
    # smallest batch bucket that fits them, to the end (the episodes are the lock-step ones: test above, same seed)
    batches = [batch for batch, _ in calls]
    first_small = next(index for index, batch in enumerate(batches) if batch < 8)
    assert batches[first_small:] == sorted(batches[first_small:], reverse=True), calls
    assert all(given <= batch for batch, given in calls), calls


def test_continuous_rows_compute_a_task_prompt_once(trainer, monkeypatch):
    """The samples of one task admitted together: the continuous loop prefills their first prompt once and copies
    it, as lock-step rounds do, instead of once per row."""
    from agentgym_jax import prefill, sampling

    written = []
    real_generate, real_prefill = sampling._generate_program, prefill.prefill_program

    def generate_spy(*args, **kwargs):
        written.append(int(np.sum(kwargs["new_lengths"])))
        return real_generate(*args, **kwargs)

    def prefill_spy(state, cache, tokens, counts, **kwargs):
        written.append(int(np.sum(counts)))
        return real_prefill(state, cache, tokens, counts, **kwargs)

    monkeypatch.setattr(sampling, "_generate_program", generate_spy)
    monkeypatch.setattr(prefill, "prefill_program", prefill_spy)
    computed = {}
    for name, continuous in (("continuous", True), ("waves", False)):
        written.clear()
        # (calls run their turns to the end, feeding each last id: an early return would feed it with the next
        # tokens, counted there)
        played, _ = _play(trainer, trainer.train_tasks[:6], True, continuous=continuous, max_rows=8, refill_after=1.0)
        computed[name] = sum(written)
    # Greedy: every episode takes 5 turns, so both loops play the same waves of 8 rows (two tasks each), and the
    # same turns. The waves prefill the opening (what every first prompt starts with) once per wave, the
    # continuous loop once in all.
    first_prompts = [t.tokens[: t.loss_mask.index(1)] for t in played]
    opening = len(os.path.commonprefix(first_prompts))
    assert opening > 10 and {t.turns for t in played} == {5}
    assert computed["continuous"] == computed["waves"] - 2 * opening, computed


def test_continuous_rows_compute_a_task_prompt_once_across_rounds(trainer, monkeypatch):
    """6 rows for tasks of 4 samples: the second task's last two samples take rows that free up rounds later. Its
    prompt is kept meanwhile, so every task's first prompt is computed once, as with 8 rows (whole tasks admitted
    together): the same tokens computed in all. Greedy: every episode takes 5 turns, in both."""
    from agentgym_jax import prefill, sampling

    written = []
    real_generate, real_prefill = sampling._generate_program, prefill.prefill_program
    monkeypatch.setattr(sampling, "_generate_program", lambda *args, **kwargs: (
        written.append(int(np.sum(kwargs["new_lengths"]))), real_generate(*args, **kwargs))[1])
    monkeypatch.setattr(prefill, "prefill_program", lambda state, cache, tokens, counts, **kwargs: (
        written.append(int(np.sum(counts))), real_prefill(state, cache, tokens, counts, **kwargs))[1])
    computed = {}
    for rows, halves in ((8, False), (6, False), (6, True)):  # halves: the first task's samples span both
        written.clear()
        played, _ = _play(trainer, trainer.train_tasks[:4], True, continuous=True, max_rows=rows,
                          async_env_steps=halves)
        assert {t.turns for t in played} == {5}
        computed[rows, halves] = sum(written)
    assert computed[6, False] == computed[6, True] == computed[8, False], computed


def test_kept_prompts_are_bounded_and_dropped_by_their_last_row(trainer):
    from agentgym_jax.shared_prompts import SharedOpening

    sampler, opening = trainer.sampler, SharedOpening()
    prompts = [[7] * 20 + [100 + task] * 10 + [9] for task in range(6)]  # a shared opening, then each task's own
    state, cached = opening.fill(sampler, sampler.new_state(8), list(enumerate(prompts)), keep=[True] * 6)
    assert cached == [30] * 6 and len(opening.ids) == 20
    assert list(opening.kept) == [tuple(ids) for ids in prompts[-SharedOpening.MAX_KEPT:]]  # the newest kept
    state = sampler.clear_rows(state, [0, 1])
    state, cached = opening.fill(sampler, state, [(0, prompts[5]), (1, prompts[4])], keep=[True, False])
    assert cached == [30, 30] and tuple(prompts[5]) in opening.kept and tuple(prompts[4]) not in opening.kept


def test_negative_rows_are_refused():
    from agentgym_jax.errors import ConfigError
    from agentgym_jax.rollout import RolloutConfig

    with pytest.raises(ConfigError, match="rollout.max_rows must be >= 0"):
        RolloutConfig(max_rows=-1).validate()


def _intervals(real, log):
    """``real``, logging each call's (start, end, thread name)."""

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            log.append((start, time.perf_counter(), threading.current_thread().name))
    return timed


@pytest.mark.parametrize("asynchronous", [False, True])
def test_async_env_steps_run_while_the_sampler_generates(trainer, monkeypatch, asynchronous):
    from environments.workers import EnvPool

    slow = EnvPool("letters", dict(turns=3, step_seconds=0.05), num_workers=0, import_modules=("tests.synthetic_env",))
    samples, steps, batch_sizes = [], [], []
    generate = trainer.sampler.generate

    def sizing_generate(state, *args, **kwargs):
        batch_sizes.append(state.batch_size)
        return generate(state, *args, **kwargs)

    monkeypatch.setattr(trainer, "pool", slow)
    monkeypatch.setattr(trainer.sampler, "generate", _intervals(sizing_generate, samples))
    monkeypatch.setattr(slow, "step", _intervals(slow.step, steps))
    try:
        trajectories, stats = _play(trainer, trainer.train_tasks[:2], True, continuous=True, max_rows=8,
                                    async_env_steps=asynchronous)
    finally:
        slow.close()
    assert all(t.turns == 3 and t.end_reason == "done" for t in trajectories)
    overlapping = [any(start < e_end and e_start < end for e_start, e_end, _ in steps) for start, end, _ in samples]
    stepped = sum(end - start for start, end, _ in steps)
    if asynchronous:  # the rows' halves alternate: 2 x 3 sampler calls, all but the first beside env steps
        assert len(samples) == 6 and set(batch_sizes) == {4}  # each half is its own sampler batch
        assert {name for *_, name in steps} == {"env-steps_0"}
        assert overlapping == [False] + [True] * 5
        assert stats.env_s < stepped  # the loop waited for less than the environments took
    else:
        assert len(samples) == 3 and set(batch_sizes) == {8} and not any(overlapping)


@pytest.mark.parametrize("continuous", [False, True])
def test_prompt_prefills_outside_generate_calls_count_as_sampling(trainer, continuous, monkeypatch):
    """The prefills, forks and row moves of shared prompts run outside generate calls; they are sampler work: a
    slowed prefill there shows in ``stats.sampling_s``, not in ``host_s``."""
    sampler, inside, slept = trainer.sampler, [], []
    generate, prefill = sampler.generate, sampler.prefill

    def timed_generate(*args, **kwargs):
        inside.append(True)
        try:
            return generate(*args, **kwargs)
        finally:
            inside.pop()

    def slow_prefill(*args, **kwargs):
        if not inside:
            time.sleep(0.3)
            slept.append(0.3)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(sampler, "generate", timed_generate)
    monkeypatch.setattr(sampler, "prefill", slow_prefill)
    _, stats = _play(trainer, trainer.train_tasks[:4], True, continuous=continuous, max_rows=8)
    assert slept, "no prompt was prefilled outside a generate call"
    assert stats.sampling_s > sum(slept) > stats.host_s, (stats, sum(slept))
