"""Prefill: length-sorted parts and chunks cost fewer positions and leave the same caches and samples as one block."""

import dataclasses

import jax
import numpy as np
import pytest

from agentgym_jax import hf, prefill, sharding
from agentgym_jax.buckets import bucket
from agentgym_jax.model import KVCache
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams
from tests.tiny_models import make_hf_model

TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
tokens = lambda n: bucket(max(1, n), TOKEN_BUCKETS)  # noqa: E731
rows = lambda n: bucket(n, BATCH_BUCKETS)  # noqa: E731


def test_one_long_prompt_among_short_ones_is_prefilled_apart():
    lengths = [150] * 5 + [370] + [150] * 6  # the demo's shape: 12 task prompts, one much longer
    parts, cost = prefill.plan_parts(lengths, tokens, rows, call_cost=256)
    # the long one alone; the eleven others as 8 + 3 rows (11 would pad to a batch of 16)
    assert parts[0] == [5] and sorted(len(p) for p in parts) == [1, 3, 8]
    assert sorted(r for p in parts for r in p) == list(range(12))
    # 1 x 512 + 8 x 256 + 4 x 256 + 3 calls = 4352 positions instead of one 16 x 512 block
    assert cost == sum(rows(len(p)) * tokens(lengths[p[0]]) + 256 for p in parts) == 4352


def test_even_or_empty_rows_are_not_split():
    assert prefill.plan_parts([100] * 8, tokens, rows, 256) == ([list(range(8))], 8 * 128 + 256)
    assert prefill.plan_parts([0, 0, 7, 0], tokens, rows, 1)[0] == [[2]]
    assert prefill.plan_parts([0, 0], tokens, rows, 1) == ([], 0)
    # a higher call price buys fewer parts
    lengths = [300, 200, 120, 60, 30, 10, 3, 1]
    assert len(prefill.plan_parts(lengths, tokens, rows, 1)[0]) > len(
        prefill.plan_parts(lengths, tokens, rows, 5000)[0]) == 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ragged")
    make_hf_model("qwen2-gqa-untied").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model(model_dir):
    return hf.load_model(model_dir)


def _two_turns(model, call_cost: int, sampling: SamplingParams, chunk: int = 0, mesh=None):
    sampler = Sampler(model, SamplerConfig(cache_length=160, prefill_call_cost=call_cost, prefill_chunk=chunk,
                                           window_buckets=(64, 128)), mesh=mesh)
    prefill_part, parts = sampler._prefill_part, []
    sampler._prefill_part = lambda state, part, rows: parts.append(len(part)) or prefill_part(state, part, rows)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(3, 200, n).tolist() for n in (70, 3, 9, 2, 40)]
    state = sampler.new_state(8)
    state = sampler.prefill(state, [p[:-1] for p in prompts])  # all but the last token, as the rollout does
    state, first = sampler.generate(state, [p[-1:] for p in prompts], jax.random.PRNGKey(0), sampling)
    observations = [rs.randint(3, 200, n).tolist() for n in (2, 33, 5, 1, 17)]
    state, second = sampler.generate(state, observations, jax.random.PRNGKey(1), sampling)
    return first, second, state.lengths, parts


def _assert_same_turns(ours, reference):
    """Two :func:`_two_turns` runs gave the same samples, log-probs (2e-5) and cache lengths."""
    for turn, expected in zip(ours[:2], reference[:2]):
        assert turn.tokens == expected.tokens
        for a, b in zip(turn.logprobs, expected.logprobs):
            np.testing.assert_allclose(a, b, atol=2e-5)
    np.testing.assert_array_equal(ours[2], reference[2])


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=6),
                                      SamplingParams(temperature=1.0, max_new_tokens=6)])
def test_parts_give_the_samples_and_caches_of_one_block(model, sampling):
    split = _two_turns(model, call_cost=1, sampling=sampling)  # every call with ragged rows splits
    whole = _two_turns(model, call_cost=0, sampling=sampling)  # 0: never split
    _assert_same_turns(split, whole)
    assert whole[3] == [] and len(split[3]) >= 6 and max(split[3]) < 5  # each of the three calls split


def test_rows_without_tokens_are_not_computed(model):
    """Prefilling 2 of 8 rows computes a 2-row part (the other 6 rows idle), with the samples of one 8-row block."""
    results = []
    for call_cost in (1, 0):
        sampler = Sampler(model, SamplerConfig(cache_length=160, prefill_call_cost=call_cost, prefill_chunk=0))
        prefill_part, parts = sampler._prefill_part, []
        sampler._prefill_part = lambda state, part, rows, call=prefill_part, parts=parts: parts.append(
            len(part)) or call(state, part, rows)
        rs = np.random.RandomState(1)
        prompts = [rs.randint(3, 200, 30).tolist() for _ in range(8)]
        state = sampler.new_state(8)
        state = sampler.prefill(state, [p[:-1] for p in prompts])
        state = sampler.prefill(state, [[5, 6, 7], None, None, None, [8, 9], None, None, None])
        state, out = sampler.generate(state, [[11]] * 8, jax.random.PRNGKey(0),
                                      SamplingParams(temperature=0.0, max_new_tokens=4))
        results.append((out, state.lengths, parts))
    (split, split_lengths, split_parts), (whole, whole_lengths, whole_parts) = results
    assert split_parts == [2] and whole_parts == []
    assert split.tokens == whole.tokens
    np.testing.assert_array_equal(split_lengths, whole_lengths)


def test_a_part_copies_out_and_back_only_the_slots_its_rows_reach(model):
    """take_rows_program gives the first slots of the chosen rows (an out-of-range index: an empty row);
    put_rows_program writes them back over those slots only, leaving every other slot and row as it was."""
    rs = np.random.RandomState(2)
    full = KVCache.zeros(model.config, 4, 32)
    full = dataclasses.replace(full, keys=[jax.numpy.asarray(rs.randn(*k.shape), k.dtype) for k in full.keys],
                               values=[jax.numpy.asarray(rs.randn(*v.shape), v.dtype) for v in full.values],
                               lengths=jax.numpy.asarray([5, 9, 3, 7], jax.numpy.int32))
    before = jax.device_get(full)
    index = jax.numpy.asarray([2, 0, 4], jax.numpy.int32)
    part = prefill.take_rows_program(full, index, window=8)
    assert part.capacity == 8 and part.lengths.tolist() == [3, 5, 0]
    np.testing.assert_array_equal(part.keys[1][:2], before.keys[1][[2, 0]][..., :8])
    np.testing.assert_array_equal(part.values[1][:2], before.values[1][[2, 0], :, :8])
    assert not np.any(np.asarray(part.keys[1][2])) and not np.any(np.asarray(part.values[0][2]))
    written = dataclasses.replace(part, keys=[k + 1 for k in part.keys], values=[v - 1 for v in part.values],
                                  lengths=part.lengths + 2)
    after = jax.device_get(prefill.put_rows_program(full, written, index))
    expected_keys, expected_values = before.keys[1].copy(), before.values[1].copy()
    expected_keys[[2, 0], ..., :8] += 1
    expected_values[[2, 0], :, :8] -= 1
    np.testing.assert_array_equal(after.keys[1], expected_keys)
    np.testing.assert_array_equal(after.values[1], expected_values)
    assert after.lengths.tolist() == [7, 9, 5, 7]


def test_chunked_prefill_gives_the_samples_and_caches_of_one_block(model):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    chunked = _two_turns(model, call_cost=0, sampling=sampling, chunk=16)  # 70 tokens: 16 x 4 + 6
    whole = _two_turns(model, call_cost=0, sampling=sampling)
    _assert_same_turns(chunked, whole)


def test_a_partial_chunk_goes_in_smaller_buckets_where_that_saves_positions(model):
    sampler = Sampler(model, SamplerConfig(prefill_chunk=128))
    assert sampler._prefill_pieces(199) == [128, 64, 7] and sampler._prefill_positions(199) == 128 + 64 + 16
    assert sampler._prefill_pieces(69) == [64, 5] and sampler._prefill_positions(69) == 80  # not 128
    assert sampler._prefill_pieces(100) == [100]  # 64 + 64 saves nothing
    assert sampler._prefill_pieces(300) == [128, 128, 44]  # 32 + 16 would save 16 of 64: not worth a call
    assert Sampler(model, SamplerConfig(prefill_chunk=0))._prefill_pieces(69) == [69]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    pieces = _two_turns(model, call_cost=0, sampling=sampling, chunk=128)  # the 69-token prefill: 64 + 5
    whole = _two_turns(model, call_cost=0, sampling=sampling)
    _assert_same_turns(pieces, whole)


def test_prefill_chunk_must_be_a_token_bucket(model):
    with pytest.raises(Exception, match="prefill_chunk=48 is not one of token_buckets"):
        Sampler(model, SamplerConfig(prefill_chunk=48))


def test_parts_and_chunks_on_a_mesh(model, model_dir):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6)
    mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])  # parts are multiples of 2 rows
    sharded = _two_turns(hf.load_model(model_dir, mesh=mesh), call_cost=1, sampling=sampling, chunk=16, mesh=mesh)
    whole = _two_turns(model, call_cost=0, sampling=sampling)
    assert [r.tokens for r in sharded[:2]] == [r.tokens for r in whole[:2]]
    np.testing.assert_array_equal(sharded[2], whole[2])
    assert len(sharded[3]) >= 3  # it did split
