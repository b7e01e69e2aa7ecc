"""A prefill piece's native KV-cache write (``native/cache_write.cc``): the same caches as the pure-JAX scatter
(``attention.write_slots``), taken by the model whenever the native kernels are on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import attention, native_kernels
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams
from tests.test_native_kernels import _use_native_kernels
from tests.test_sampling import PROMPTS, _pair


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim,pieces", [(8, 5), (64, 16), (3, 1)])
def test_the_kernel_writes_what_write_slots_writes(dtype, head_dim, pieces):
    rows, kv_heads, slots = 5, 2, 20
    rng = np.random.RandomState(head_dim + pieces)
    keys = attention.to_storage(jnp.asarray(rng.randn(rows, kv_heads, head_dim, slots), dtype))
    values = attention.to_storage(jnp.asarray(rng.randn(rows, kv_heads, slots, head_dim), dtype))
    new_keys = jnp.asarray(rng.randn(rows, pieces, kv_heads, head_dim), dtype)
    new_values = jnp.asarray(rng.randn(rows, pieces, kv_heads, head_dim), dtype)
    # from the start; in the middle; running past the end (its last entries dropped); at the end; past it
    starts = jnp.asarray([0, 7, slots - pieces // 2 - 1, slots, slots + 3], jnp.int32)
    written = jax.jit(native_kernels.cache_write, static_argnums=5)(keys, values, new_keys, new_values, starts, dtype)
    slots_written = starts[:, None] + jnp.arange(pieces)[None, :]
    expected = (attention.write_slots(keys, slots_written, new_keys, dtype, attention.KEY_SLOT_AXIS),
                attention.write_slots(values, slots_written, new_values, dtype, attention.VALUE_SLOT_AXIS))
    for ours, reference, before in zip(written, expected, (keys, values)):
        assert ours.dtype == before.dtype and ours.shape == before.shape
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))
    assert not np.array_equal(np.asarray(written[0]), np.asarray(keys))  # something was written
    with pytest.raises(TypeError, match="fp32 or bf16-bit"):
        native_kernels.cache_write(keys.astype(jnp.int32), values, new_keys, new_values, starts, dtype)


def test_prefill_writes_with_the_kernel_and_keeps_the_pure_jax_caches(tmp_path_factory, monkeypatch):
    _, model, _ = _pair("qwen2-gqa-untied", tmp_path_factory)
    calls, kernel = [], native_kernels.cache_write
    monkeypatch.setattr(native_kernels, "cache_write", lambda *args: calls.append(1) or kernel(*args))
    caches = {}
    for setting in ("1", "0"):
        _use_native_kernels(monkeypatch, setting)
        sampler = Sampler(model, SamplerConfig(cache_length=64))
        state, _ = sampler.generate(sampler.new_state(len(PROMPTS)), PROMPTS, jax.random.PRNGKey(0),
                                    SamplingParams(temperature=0.0, max_new_tokens=1))
        caches[setting] = state.cache
        assert bool(calls) == (setting == "1")
        calls.clear()
    ours, reference = caches["1"], caches["0"]
    np.testing.assert_array_equal(np.asarray(ours.lengths), np.asarray(reference.lengths))
    # the slots each row filled (past them, padding entries that differ with how the prompts were split)
    for row, length in enumerate(np.asarray(reference.lengths)[:len(PROMPTS)]):  # the state may hold spare rows
        assert length >= len(PROMPTS[row])
        for layer in range(len(reference.keys)):
            for mine, theirs, axis in ((ours.keys, reference.keys, 2), (ours.values, reference.values, 1)):
                a, b = (np.take(np.asarray(x[layer][row], np.float32), np.arange(length), axis=axis)
                        for x in (mine, theirs))
                assert np.abs(b).max() > 0
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
