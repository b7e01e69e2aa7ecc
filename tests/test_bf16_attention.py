"""The AVX512-BF16 attention kernel (a prompt's prefill, forward only, CPUs without AMX): equal to the pure-JAX
attention within bf16 rounding, no less accurate than it against fp32, zeros for a query with no allowed key, and
taken by the sampler's bf16 prefill only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from agentgym_jax import attention, native_kernels, sampling
from agentgym_jax.model import DecoderLM, ModelConfig
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams
from tests.test_native_kernels import _use_native_kernels

pytestmark = pytest.mark.skipif(not native_kernels.avx512_bf16_available() or native_kernels.amx_available(),
                                reason="this CPU has no AVX512-BF16, or has AMX (amx_attention takes prompts)")
SCALE = 0.125


def _case(batch, queries, kv_heads, groups, head, cached=0, window=None, seed=0):
    """bf16 q [B, S, K, G, H], keys [B, K, H, T], values [B, K, T, H] and a causal ``allowed`` [B, S, T] for queries
    at slots cached..cached+S-1 (a prompt after ``cached`` cached tokens) in a cache window of T slots."""
    rng = np.random.RandomState(seed)
    keys = window or queries + cached
    q, k, v = (jnp.asarray(rng.randn(*shape), jnp.bfloat16) for shape in (
        (batch, queries, kv_heads, groups, head), (batch, kv_heads, head, keys), (batch, kv_heads, keys, head)))
    allowed = np.arange(keys)[None, :] <= np.arange(queries)[:, None] + cached
    return q, k, v, jnp.asarray(np.repeat(allowed[None], batch, 0))


def _attend(attend, q, k, v, allowed):
    return np.asarray(jax.jit(lambda q, k, v, a: attend(q, k, v, a, SCALE))(q, k, v, allowed), np.float32)


@pytest.mark.parametrize("batch,queries,kv_heads,groups,head,cached,window", [
    (2, 128, 3, 3, 64, 0, None),  # a first chunk: 16 blocks of 8 queries, 4 blocks of 32 keys
    (1, 40, 3, 3, 64, 0, 64),  # keys not a multiple of 32; a window past the last one any query reads
    (2, 37, 2, 2, 64, 50, 128),  # a prompt prefilled after 50 cached tokens: a tail of 5 queries
    (3, 19, 1, 4, 128, 13, 33),  # a head of 128; a window of 33 slots
    (1, 9, 2, 1, 32, 0, None),  # a head of 32; keys fewer than a block
])
def test_kernel_equals_the_pure_jax_attention(batch, queries, kv_heads, groups, head, cached, window):
    q, k, v, allowed = _case(batch, queries, kv_heads, groups, head, cached, window)
    ours = _attend(native_kernels.bf16_attention, q, k, v, allowed)
    pure = _attend(attention.attend, q, k, v, allowed)
    exact = _attend(attention.attend, *(x.astype(jnp.float32) for x in (q, k, v)), allowed)
    assert ours.shape == q.shape and np.abs(exact).max() > 0.1
    # the same fp32 softmax and bf16 roundings: at most a bf16 step or two apart ...
    np.testing.assert_allclose(ours, pure, atol=1.6e-2 * np.abs(pure).max())
    # ... and no further from the fp32 attention than the pure-JAX bf16 path is
    assert np.abs(ours - exact).max() <= 1.5 * np.abs(pure - exact).max() + 1e-3 * np.abs(exact).max()


def test_a_query_with_no_allowed_key_gets_zeros_and_nan_past_the_window_is_never_read():
    q, k, v, allowed = _case(1, 48, 2, 2, 64, window=80)
    allowed = allowed.at[0, 20].set(False).at[0, 40:].set(False)  # one query, and a whole block of 8, blind
    v = v.at[:, :, 48:].set(jnp.nan)  # slots no query may read (a cache past its rows' lengths)
    k = k.at[:, :, :, 48:].set(jnp.nan)
    ours = _attend(native_kernels.bf16_attention, q, k, v, allowed)
    assert not ours[0, 20].any() and not ours[0, 40:].any() and np.isfinite(ours).all()
    pure = _attend(attention.attend, q, k, v.at[:, :, 48:].set(0), allowed)
    np.testing.assert_allclose(ours[0, :20], pure[0, :20], atol=1.6e-2 * np.abs(pure).max())


def test_applies_only_to_bf16_prompts_in_inference_programs(monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    q, k, v, _ = _case(2, 32, 2, 2, 64)
    assert not native_kernels.bf16_attention_applies(q, k, v)  # a program that may be differentiated
    with native_kernels.inference_only():
        assert native_kernels.bf16_attention_applies(q, k, v)
        assert not native_kernels.bf16_attention_applies(q, k[:1], v[:1])  # keys of another batch
        assert not native_kernels.bf16_attention_applies(q, k, v[:, :, :16])  # values of fewer slots
        assert not native_kernels.bf16_attention_applies(*(x.astype(jnp.float32) for x in (q, k, v)))
        assert not native_kernels.bf16_attention_applies(q[..., :48], k[:, :, :48], v[..., :48])  # H of 48
        _use_native_kernels(monkeypatch, "0")
        assert not native_kernels.bf16_attention_applies(q, k, v)


def test_bf16_sampling_prefills_on_the_kernel_with_the_pure_jax_tokens(monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    config = ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         param_dtype="bfloat16", dtype="bfloat16")
    model = DecoderLM(config, nnx.Rngs(0))
    program, compiled, outputs = sampling.prefill.prefill_program, [], []
    monkeypatch.setattr(sampling.prefill, "prefill_program", lambda *a, **k: compiled.append(
        program.lower(*a, **k).as_text()) or program(*a, **k))
    applies = native_kernels.bf16_attention_applies
    for on in (True, False):
        monkeypatch.setattr(native_kernels, "bf16_attention_applies", lambda *a, on=on: on and applies(*a))
        jax.clear_caches()
        sampler = Sampler(model, SamplerConfig(cache_length=64))
        _, out = sampler.generate(sampler.new_state(2), [[7, 8, 9] * 7 + [5], [9, 3] * 12 + [6]], jax.random.PRNGKey(0),
                                  SamplingParams(temperature=0.0, max_new_tokens=6))
        outputs.append(out)
    target = native_kernels.BF16_ATTENTION.target
    assert len(compiled) == 2 and f"@{target}(" in compiled[0] and target not in compiled[1]  # one prefill call each
    assert outputs[0].tokens == outputs[1].tokens and len(outputs[0].tokens[0]) == 6
    for a, b in zip(outputs[0].logprobs, outputs[1].logprobs):
        np.testing.assert_allclose(a, b, atol=5e-2)
