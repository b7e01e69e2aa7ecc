"""The native CPU decode-attention kernel: equal to the pure-JAX step it replaces, used by the sampler, and clear
errors when it cannot be built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import attention, hf, native_kernels, sampling, sharding
from agentgym_jax.errors import ConfigError
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams
from tests.test_sampling import PROMPTS, _pair


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_attention_equals_attend_one_query(dtype):
    rows, kv_heads, groups, head_dim, slots = 5, 2, 3, 32, 40
    rng = np.random.RandomState(0)
    keys = jnp.asarray(rng.randn(rows, kv_heads, head_dim, slots) * 2, dtype)
    values = jnp.asarray(rng.randn(rows, kv_heads, slots, head_dim), dtype)
    q = jnp.asarray(rng.randn(rows, 1, kv_heads, groups, head_dim), dtype)
    # Past each row's limit the cache holds large entries: reading them would change the output.
    limits = jnp.asarray([1, 17, 33, slots, slots + 9], jnp.int32)
    beyond = jnp.arange(slots) >= limits[:, None, None, None]
    keys = jnp.where(beyond, jnp.asarray(50, dtype), keys)
    values = jnp.where(jnp.swapaxes(beyond, 2, 3), jnp.asarray(-80, dtype), values)

    out = native_kernels.decode_attention(q, attention.to_storage(keys), attention.to_storage(values), limits, 0.17)
    allowed = (jnp.arange(slots)[None, :] < jnp.clip(limits, 1, slots)[:, None])[:, None]
    expected = attention.attend_one_query(q, keys, values, allowed, 0.17)

    assert out.dtype == q.dtype and out.shape == expected.shape
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=tolerance,
                               rtol=tolerance)
    # Row 0 reads slot 0 only: its output is that slot's value, whatever its score.
    first_slot = np.asarray(values[0, :, 0], np.float32)[:, None, :]  # [K, 1, H]
    np.testing.assert_allclose(np.asarray(out[0, 0], np.float32), np.broadcast_to(first_slot, out.shape[2:]),
                               atol=tolerance)


def test_sampler_uses_the_kernel_and_generates_what_the_pure_jax_path_does(tmp_path_factory, monkeypatch):
    _, model, _ = _pair("qwen2-gqa-untied", tmp_path_factory)
    calls = []
    kernel = native_kernels.decode_attention
    monkeypatch.setattr(native_kernels, "decode_attention", lambda *args: calls.append(1) or kernel(*args))

    def two_turns(setting):
        monkeypatch.setenv(native_kernels.ENV_VAR, setting)
        jax.clear_caches()  # programs are traced again under the setting
        sampler = Sampler(model, SamplerConfig(cache_length=128))
        state = sampler.new_state(len(PROMPTS))
        params = SamplingParams(temperature=0.0, max_new_tokens=12)
        state, first = sampler.generate(state, PROMPTS, jax.random.PRNGKey(0), params)
        _, second = sampler.generate(state, [[7, 8, 9]] * len(PROMPTS), jax.random.PRNGKey(1), params)
        return first, second

    native = two_turns("1")
    assert calls, "the decode step did not call the native kernel"
    calls.clear()
    pure = two_turns("0")
    assert not calls
    for ours, reference in zip(native, pure):
        assert ours.tokens == reference.tokens
        for a, b in zip(ours.logprobs, reference.logprobs):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_generate_reads_the_whole_cache_with_the_kernel(tmp_path_factory, monkeypatch):
    """With the kernel, a call's new tokens but each row's last are prefilled first, and the generate program,
    then decode steps only, runs over the whole cache (no window copied out and back; one program whatever the
    prompts' lengths and the rows' reach), with the samples of the windowed pure-JAX calls."""
    _, model, model_dir = _pair("qwen2-gqa-untied", tmp_path_factory)
    windows = []
    program = sampling._generate_program
    monkeypatch.setattr(sampling, "_generate_program", lambda *a, **k: windows.append(k["window"]) or program(*a, **k))

    def three_turns(setting, mesh=None):
        monkeypatch.setenv(native_kernels.ENV_VAR, setting)
        jax.clear_caches()
        windows.clear()
        sampler = Sampler(hf.load_model(model_dir, mesh=mesh) if mesh else model,
                          SamplerConfig(cache_length=128, window_buckets=(32, 64)), mesh=mesh)
        state, turns = sampler.new_state(2), []
        for turn in range(3):  # the rows reach 32, 64 and 96 slots
            state, out = sampler.generate(state, [[7 + turn] * 20 + [5], [9] * 25 + [6]], jax.random.PRNGKey(turn),
                                          SamplingParams(temperature=1.0, max_new_tokens=6))
            turns.append(out)
        return turns, list(windows)

    native, native_windows = three_turns("1")
    pure, pure_windows = three_turns("0")
    assert native_windows == [128] * 3 and pure_windows == [32, 64, 128]
    # on a mesh of several devices the kernel does not run: the calls keep their windows
    sharded, sharded_windows = three_turns("1", sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2]))
    assert sharded_windows == [32, 64, 128]
    assert [turn.tokens for turn in sharded] == [turn.tokens for turn in pure]
    for ours, reference in zip(native, pure):
        assert ours.tokens == reference.tokens
        for a, b in zip(ours.logprobs, reference.logprobs):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_unknown_setting_and_missing_compiler_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv(native_kernels.ENV_VAR, "yes")
    with pytest.raises(ConfigError, match="use 1 .* or 0"):
        native_kernels.enabled()
    monkeypatch.setenv(native_kernels.ENV_VAR, "0")
    assert not native_kernels.enabled()

    monkeypatch.setenv("AGENTGYM_JAX_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ConfigError, match="AGENTGYM_JAX_NATIVE_KERNELS=0"):
        native_kernels.build()
    assert not (tmp_path / "native").exists() or not any((tmp_path / "native").glob("*.so"))
