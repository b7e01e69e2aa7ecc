"""The sampler: parity with transformers, log-probs, multi-turn extend, sampling rules, buckets, meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from agentgym_jax import hf, native_kernels, sampling, sharding
from agentgym_jax.errors import ConfigError
from agentgym_jax.model import KVCache
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams, StopReason
from tests.tiny_models import make_hf_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32)
PROMPTS = [[5, 6, 7, 8, 9, 3], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


def _pair(variant, tmp_path_factory):
    reference = make_hf_model(variant)
    directory = tmp_path_factory.mktemp(variant)
    reference.save_pretrained(directory)
    return reference, hf.load_model(directory), directory


@pytest.fixture(scope="module", params=["llama-gqa-tied", "qwen2-gqa-untied", "qwen3-gqa-tied", "llama32-tied"])
def both(request, tmp_path_factory):
    """Parity tests run on every family."""
    return _pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _pair("llama-gqa-tied", tmp_path_factory)


def _teacher_forced_logprobs(model, ids):
    logits = np.asarray(model(jnp.asarray([ids])))[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return np.array([logp[t - 1, ids[t]] for t in range(1, len(ids))]), logits


def test_greedy_matches_transformers_generate(both):
    reference, ours, _ = both
    sampler = Sampler(ours, SamplerConfig(cache_length=128))
    _, result = sampler.generate(sampler.new_state(len(PROMPTS)), PROMPTS, jax.random.PRNGKey(0), GREEDY)
    for prompt, tokens in zip(PROMPTS, result.tokens):
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt):].tolist()
        assert tokens == expected


def test_logprobs_equal_teacher_forced_forward(both):
    _, ours, _ = both
    sampler = Sampler(ours, SamplerConfig(cache_length=128))
    _, result = sampler.generate(
        sampler.new_state(3), PROMPTS, jax.random.PRNGKey(1), SamplingParams(temperature=1.0, max_new_tokens=24)
    )
    for prompt, tokens, logprobs in zip(PROMPTS, result.tokens, result.logprobs):
        expected, _ = _teacher_forced_logprobs(ours, prompt + tokens)
        np.testing.assert_allclose(logprobs, expected[len(prompt) - 1:], atol=1e-4)


def test_multi_turn_extend_equals_teacher_forcing_on_the_whole_history(pair):
    _, ours, _ = pair
    sampler = Sampler(ours, SamplerConfig(cache_length=256))
    state = sampler.new_state(3)
    histories = [list(p) for p in PROMPTS]
    rng = jax.random.PRNGKey(2)
    observations = [[[30, 31, 32], [40], [50, 51, 52, 53, 54, 55, 56]], [[60, 61], [70, 71, 72, 73], [80]]]
    new = [list(p) for p in PROMPTS]
    all_turns = []
    for turn in range(3):
        rng, key = jax.random.split(rng)
        state, result = sampler.generate(state, new, key, SamplingParams(temperature=1.0, max_new_tokens=10))
        all_turns.append(result)
        for b in range(3):
            histories[b] += result.tokens[b]
        if turn < 2:
            new = observations[turn]
            for b in range(3):
                histories[b] += new[b]
    assert list(state.lengths[:3]) == [len(h) for h in histories]
    # Every sampled token's log-prob equals the teacher-forced one over the concatenated history.
    for b in range(3):
        expected, _ = _teacher_forced_logprobs(ours, histories[b])
        position = len(PROMPTS[b])
        for turn, result in enumerate(all_turns):
            n = len(result.tokens[b])
            np.testing.assert_allclose(result.logprobs[b], expected[position - 1: position - 1 + n], atol=1e-4)
            position += n + (len(observations[turn][b]) if turn < 2 else 0)


def test_extend_logits_equal_prefill_from_scratch(pair):
    _, ours, _ = pair
    history = list(range(3, 40))
    cache = KVCache.zeros(ours.config, 1, 64)
    # Prefill in three uneven chunks, then compare every chunk's logits with one full prefill.
    chunks, logits_chunks = [history[:9], history[9:10], history[10:]], []
    for chunk in chunks:
        hidden, cache = ours.forward(jnp.asarray([chunk]), cache=cache)
        cache.lengths = cache.lengths + len(chunk)
        logits_chunks.append(np.asarray(ours.logits(hidden))[0])
    full = np.asarray(ours(jnp.asarray([history])))[0]
    np.testing.assert_allclose(np.concatenate(logits_chunks), full, atol=1e-5)


def test_top_k_and_top_p_stay_inside_their_sets(pair):
    _, ours, _ = pair
    sampler = Sampler(ours, SamplerConfig(cache_length=64))
    prompts = [[7, 8, 9]] * 16
    for params, check in [
        (SamplingParams(temperature=1.5, top_k=3, max_new_tokens=6), "k"),
        (SamplingParams(temperature=1.5, top_p=0.5, max_new_tokens=6), "p"),
    ]:
        _, result = sampler.generate(sampler.new_state(16), prompts, jax.random.PRNGKey(3), params)
        for tokens in result.tokens:
            _, logits = _teacher_forced_logprobs(ours, prompts[0] + tokens)
            for step, token in enumerate(tokens):
                scaled = logits[len(prompts[0]) - 1 + step] / params.temperature
                order = np.argsort(-scaled)
                if check == "k":
                    assert token in order[:3]
                else:
                    probs = np.exp(scaled - scaled.max())
                    probs = probs[order] / probs.sum()
                    nucleus = order[: int(np.searchsorted(np.cumsum(probs), 0.5) + 1)]
                    assert token in nucleus
        distinct = {tuple(t) for t in result.tokens}
        assert len(distinct) > 1  # really sampling


def test_seed_reproducible_and_low_temperature_is_greedy(pair):
    _, ours, _ = pair
    sampler = Sampler(ours, SamplerConfig(cache_length=64))
    hot = SamplingParams(temperature=1.0, max_new_tokens=12)
    run = lambda key, p: sampler.generate(sampler.new_state(3), PROMPTS, key, p)[1].tokens
    assert run(jax.random.PRNGKey(4), hot) == run(jax.random.PRNGKey(4), hot)
    assert run(jax.random.PRNGKey(4), hot) != run(jax.random.PRNGKey(5), hot)
    cold = SamplingParams(temperature=1e-5, max_new_tokens=12)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    assert run(jax.random.PRNGKey(6), cold) == run(jax.random.PRNGKey(7), greedy)


def test_stop_tokens_sequences_and_cache_full(pair):
    _, ours, _ = pair
    free = Sampler(ours, SamplerConfig(cache_length=128))
    _, reference = free.generate(free.new_state(1), [PROMPTS[0]], jax.random.PRNGKey(0), GREEDY)
    tokens = reference.tokens[0]
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    with_stop = Sampler(ours, SamplerConfig(cache_length=128, stop_token_ids=(stop_id,)))
    _, result = with_stop.generate(with_stop.new_state(1), [PROMPTS[0]], jax.random.PRNGKey(0), GREEDY)
    assert result.tokens[0] == tokens[: first + 1] and result.stop_reasons[0] == StopReason.STOP_TOKEN
    pair_seq = (tokens[6], tokens[7])
    with_seq = Sampler(ours, SamplerConfig(cache_length=128, stop_sequences=(pair_seq,)))
    _, result = with_seq.generate(with_seq.new_state(1), [PROMPTS[0]], jax.random.PRNGKey(0), GREEDY)
    end = next(i for i in range(1, len(tokens)) if (tokens[i - 1], tokens[i]) == pair_seq)
    assert result.tokens[0] == tokens[: end + 1] and result.stop_reasons[0] == StopReason.STOP_SEQUENCE
    # A small cache: the row stops with CACHE_FULL after filling it exactly, never truncating history.
    small = Sampler(ours, SamplerConfig(cache_length=16))
    state, result = small.generate(small.new_state(1), [PROMPTS[0]], jax.random.PRNGKey(0), GREEDY)
    assert result.stop_reasons[0] == StopReason.CACHE_FULL
    assert result.tokens[0] == tokens[: 16 - len(PROMPTS[0])]
    assert state.lengths[0] == 16
    # New tokens that do not fit are refused up front with the same reason.
    state, result = small.generate(state, [[1, 2, 3]], jax.random.PRNGKey(0), GREEDY)
    assert result.stop_reasons[0] == StopReason.CACHE_FULL and result.tokens[0] == []


def test_inactive_and_dropped_rows_do_not_disturb_others(pair):
    _, ours, _ = pair
    sampler = Sampler(ours, SamplerConfig(cache_length=128))
    first_turn = lambda: sampler.generate(sampler.new_state(3), PROMPTS, jax.random.PRNGKey(0), GREEDY)[0]
    follow = [[40, 41], None, [42]]
    state = first_turn()
    _, masked = sampler.generate(state, follow, jax.random.PRNGKey(0), GREEDY)
    assert masked.stop_reasons[1] == StopReason.INACTIVE and masked.tokens[1] == []
    with pytest.raises(ConfigError, match="consumed"):
        sampler.generate(state, follow, jax.random.PRNGKey(0), GREEDY)
    compact = sampler.select_rows(first_turn(), [0, 2])
    assert compact.batch_size == 2
    _, dropped = sampler.generate(compact, [follow[0], follow[2]], jax.random.PRNGKey(0), GREEDY)
    assert dropped.tokens == [masked.tokens[0], masked.tokens[2]]


def test_multi_turn_rollout_compiles_a_bounded_number_of_programs(pair):
    _, ours, _ = pair
    sampler = Sampler(ours, SamplerConfig(cache_length=512))
    rng = np.random.RandomState(0)
    state = sampler.new_state(3)
    before = sampler.compilations
    new = [list(rng.randint(3, 200, rng.randint(5, 60))) for _ in range(3)]
    for turn in range(6):  # at most 60 + 16 + 5 * (20 + 16) = 256 positions: the model's whole context
        params = SamplingParams(temperature=1.0, max_new_tokens=int(rng.randint(4, 16)))
        state, _ = sampler.generate(state, new, jax.random.PRNGKey(turn), params)
        new = [list(rng.randint(3, 200, rng.randint(1, 20))) for _ in range(3)]
    # Widths fall in buckets {16, 32, 64} and max_new in {16}: at most 3 programs for 6 varied turns.
    assert sampler.compilations - before <= 3


def test_eight_device_mesh_gives_the_same_tokens(pair):
    _, ours, directory = pair
    prompts = PROMPTS + [[3, 4]] * 5
    single = Sampler(ours, SamplerConfig(cache_length=128))
    _, expected = single.generate(single.new_state(8), prompts, jax.random.PRNGKey(0), GREEDY)
    mesh = sharding.make_mesh((4, 2, 1))
    sharded_model = hf.load_model(directory, mesh=mesh)
    sampler = Sampler(sharded_model, SamplerConfig(cache_length=128), mesh=mesh)
    state, result = sampler.generate(sampler.new_state(8), prompts, jax.random.PRNGKey(0), GREEDY)
    assert result.tokens == expected.tokens
    assert state.cache.keys[0].sharding.is_equivalent_to(sharding.named_sharding(mesh, "kv_cache"), 4)
    # The sampler reads the model's own parameter arrays: no copy.
    kernel = sharded_model.model.layers[0].mlp.up_proj.kernel[...]
    assert sampler.state["model"]["layers"][0]["mlp"]["up_proj"]["kernel"][...] is kernel


def test_shared_prompt_prefilled_once_and_forked_samples_like_separate_prefills(pair):
    _, ours, _ = pair
    sampler = Sampler(ours, SamplerConfig(cache_length=128))
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[0]]
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    _, separate = sampler.generate(sampler.new_state(4), prompts, jax.random.PRNGKey(3), params)
    shared = sampler.prefill(sampler.new_state(2), [PROMPTS[0][:-1], PROMPTS[2][:-1]])
    assert shared.lengths[:2].tolist() == [len(PROMPTS[0]) - 1, len(PROMPTS[2]) - 1]
    forked = sampler.select_rows(shared, [0, 0, 1, 0])
    _, result = sampler.generate(forked, [p[-1:] for p in prompts], jax.random.PRNGKey(3), params)
    assert result.tokens == separate.tokens
    for a, b in zip(result.logprobs, separate.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-4)
    with pytest.raises(ConfigError, match="does not fit the sampler cache"):
        sampler.prefill(sampler.new_state(1), [list(range(3, 140))])


def test_logprobs_at_the_learner_temperature(pair):
    _, ours, _ = pair
    sampler = Sampler(ours, SamplerConfig(cache_length=128, logprob_temperature=0.7))
    _, result = sampler.generate(sampler.new_state(1), PROMPTS[:1], jax.random.PRNGKey(2),
                                 SamplingParams(temperature=0.7, max_new_tokens=8))
    ids = PROMPTS[0] + result.tokens[0]
    logits = np.asarray(ours(jnp.asarray([ids])))[0] / 0.7
    expected = jax.nn.log_softmax(logits, axis=-1)
    n = len(PROMPTS[0])
    np.testing.assert_allclose(result.logprobs[0], [expected[n + i - 1, t] for i, t in enumerate(result.tokens[0])],
                               atol=1e-4)


def _dot_count(lowered) -> int:
    """Matrix products in a lowered program: XLA's dots and the native projection kernels' calls."""
    text = lowered.as_text()
    kernels = (native_kernels.STRIP_MATMUL, native_kernels.AMX_MATMUL, native_kernels.AMX_MATMUL_PACKED,
               native_kernels.AMX_GEMM)
    return text.count("stablehlo.dot_general") + sum(text.count(f"@{kernel.target}(") for kernel in kernels)


def test_a_one_token_call_holds_one_copy_of_the_model(pair):
    """Prompts arrive prefilled but for their last token, so most calls bring one token a row; their program
    feeds it through the decode loop's forward instead of a second copy of every layer (half the build time)."""
    _, ours, _ = pair
    sampler = Sampler(ours, SamplerConfig(cache_length=64))
    cache = sampler.new_state(2).cache
    rows = jnp.ones((2,), jnp.int32)

    def program(width: int):
        return sampling._generate_program.lower(
            sampler.state, cache, jnp.ones((2, width), jnp.int32), rows, jax.random.split(jax.random.PRNGKey(0), 2),
            jnp.ones((2,), jnp.float32), jnp.ones((2,), jnp.float32), jnp.zeros((2,), jnp.int32), rows * 4,
            jnp.zeros((2,), jnp.int32), jnp.full((2, 1), -1, jnp.int32), jnp.int32(2), {}, graphdef=sampler.graphdef, max_new=16, stop_ids=(2,), stop_sequences=(), filtered=False, window=64)

    def one_step(state, cache, token):
        model = nnx.merge(sampler.graphdef, state)
        hidden, cache = model.forward(token, cache=cache)
        return model.logits(hidden), cache

    forward_dots = _dot_count(jax.jit(one_step).lower(sampler.state, cache, jnp.ones((2, 1), jnp.int32)))
    assert forward_dots >= 2 * ours.config.num_hidden_layers  # it counts the layers' products
    assert _dot_count(program(1)) == forward_dots
    assert _dot_count(program(4)) > forward_dots + ours.config.num_hidden_layers  # a block adds a whole forward
