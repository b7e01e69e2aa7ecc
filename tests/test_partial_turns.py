"""Sampler calls that return early (``stop_after``) and rows that resume mid-turn: the same turns, ids, log-probs
and caches as one uninterrupted call."""

import jax
import numpy as np
import pytest

from agentgym_jax import hf
from agentgym_jax.errors import ConfigError
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams, StopReason
from tests.tiny_models import make_hf_model

PROMPTS = [[5, 6, 7, 8, 9, 3], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [4, 9]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("partial")
    make_hf_model("llama-gqa-tied").save_pretrained(directory)
    return hf.load_model(directory)


def _keys(n):
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.PRNGKey(3), np.arange(n))


def _play_turns(sampler, prompts, params, stop_after):
    """Calls ``generate`` (``stop_after``) until no row is mid-turn: each row's finished turn, the state and the
    results of every call."""
    state, keys = sampler.new_state(len(prompts)), _keys(len(prompts))
    rows, finished, calls = list(prompts), {}, []
    while True:
        state, result = sampler.generate(state, rows, jax.random.PRNGKey(0), params, row_keys=keys,
                                         stop_after=stop_after)
        calls.append(result)
        for b, reason in enumerate(result.stop_reasons):
            if reason not in (StopReason.RUNNING, StopReason.INACTIVE):
                finished[b] = (result.tokens[b], result.logprobs[b], reason)
        if not state.partial:
            return finished, state, calls
        rows = [None] * len(prompts)  # rows mid-turn go on; finished rows stay out


def _next_turn(sampler, state):
    """A greedy second turn for every row: equal ids only if the caches hold the same history."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    _, result = sampler.generate(state, [[7, 8]] * state.batch_size, jax.random.PRNGKey(0), greedy)
    return result.tokens


def _compare_with_one_call(model, stop_after):
    """Plays four sampled turns of different lengths with early returns and in one call, asserts they are the
    same; whether some turn's last id was left unfed."""
    sampler = Sampler(model, SamplerConfig(cache_length=128))
    params = [SamplingParams(temperature=1.0, max_new_tokens=n) for n in (12, 3, 7, 5)]
    whole, whole_state, whole_calls = _play_turns(sampler, PROMPTS, params, stop_after=0)
    parts, state, calls = _play_turns(sampler, PROMPTS, params, stop_after=stop_after)
    assert len(whole_calls) == 1 and len(calls) > 1
    first = calls[0].stop_reasons
    assert sum(r != StopReason.RUNNING for r in first) == stop_after  # it returned as soon as it could
    assert first[0] == StopReason.RUNNING and len(calls[0].tokens[0]) < 12  # the longest row was interrupted
    for b in range(len(PROMPTS)):
        assert parts[b][0] == whole[b][0] and parts[b][2] == whole[b][2]
        np.testing.assert_allclose(parts[b][1], whole[b][1], atol=1e-5)
    # a turn that finished in a call's last step has its last id fed ahead of the row's next tokens
    unfed = np.isin(np.arange(len(PROMPTS)), list(state.unfed))
    np.testing.assert_array_equal(state.lengths + unfed, whole_state.lengths)
    assert not whole_state.unfed and _next_turn(sampler, state) == _next_turn(sampler, whole_state)
    return bool(state.unfed)


@pytest.mark.parametrize("stop_after", [1, 2])
def test_early_returns_resume_to_the_uninterrupted_turns(model, stop_after):
    left_unfed = _compare_with_one_call(model, stop_after)
    assert left_unfed or stop_after == 2  # with 1, the call returned in the step that drew a turn's last id


def test_a_stop_sequence_across_two_calls_still_stops(model):
    free = Sampler(model, SamplerConfig(cache_length=128))
    sampled = SamplingParams(temperature=1.0, max_new_tokens=24)
    tokens = _play_turns(free, PROMPTS[:1], [sampled], stop_after=0)[0][0][0]
    j = next(j for j in range(3, len(tokens)) if (tokens[j - 1], tokens[j]) not in zip(tokens[: j - 1], tokens[1:j]))
    sampler = Sampler(model, SamplerConfig(cache_length=128, stop_sequences=((tokens[j - 1], tokens[j]),)))
    # row 1 finishes after j - 1 ids, so the first call returns with row 0's last id the sequence's first
    params = [sampled, SamplingParams(temperature=1.0, max_new_tokens=j - 1)]
    parts, _, calls = _play_turns(sampler, PROMPTS[:2], params, stop_after=1)
    assert calls[0].stop_reasons[0] == StopReason.RUNNING and calls[0].tokens[0][-1] == tokens[j - 1]
    assert parts[0][0] == tokens[: j + 1] and parts[0][2] == StopReason.STOP_SEQUENCE


def test_rows_mid_turn_refuse_new_tokens_and_follow_their_rows(model):
    sampler = Sampler(model, SamplerConfig(cache_length=128))
    params = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (10, 2)]
    state, result = sampler.generate(sampler.new_state(2), PROMPTS[:2], jax.random.PRNGKey(0), params, stop_after=1)
    assert result.stop_reasons == [StopReason.RUNNING, StopReason.MAX_TOKENS] and set(state.partial) == {0}
    with pytest.raises(ConfigError, match="row 0 is mid-turn"):
        sampler.generate(state, [[1, 2], None], jax.random.PRNGKey(0), params)
    with pytest.raises(ConfigError, match="mid-turn"):
        sampler.prefill(state, [[1, 2], None])
    moved = sampler.select_rows(state, [1, 0])  # row 0's turn moves with its cache to row 1
    assert set(moved.partial) == {1}
    _, moved_result = sampler.generate(moved, [None, None], jax.random.PRNGKey(0), params)
    _, whole = sampler.generate(sampler.new_state(1), PROMPTS[:1], jax.random.PRNGKey(0), params[0])
    assert moved_result.tokens[1] == whole.tokens[0] and moved_result.stop_reasons[1] == StopReason.MAX_TOKENS
    cleared = sampler.clear_rows(state, [0])  # an emptied row's turn is gone: it takes new tokens again
    assert not cleared.partial
    _, again = sampler.generate(cleared, PROMPTS[:1], jax.random.PRNGKey(0), params[0])
    assert again.tokens[0] == whole.tokens[0]
