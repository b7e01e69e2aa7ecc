"""The decode kernel against the general one, and cache writes held as raw bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import attention


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_one_query_kernel_equals_the_batched_dots(dtype, atol):
    b, k, g, t, h = 3, 2, 3, 17, 8
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (b, 1, k, g, h)).astype(dtype)
    cache_k = jax.random.normal(keys[1], (b, k, h, t)).astype(dtype)
    cache_v = jax.random.normal(keys[2], (b, k, t, h)).astype(dtype)
    lengths = jnp.asarray([0, 5, 16])  # row 0 sees one slot, row 2 all of them
    allowed = (jnp.arange(t)[None, None, :] <= lengths[:, None, None])  # [B, 1, T]
    general = attention.attend(q, cache_k, cache_v, allowed, 0.35)
    decode = attention.attend_one_query(q, cache_k, cache_v, allowed, 0.35)
    assert decode.shape == general.shape == (b, 1, k, g, h) and decode.dtype == dtype
    np.testing.assert_allclose(np.asarray(decode, np.float32), np.asarray(general, np.float32), atol=atol)
    # Row 0 attends to slot 0 alone: its output is that slot's value, per kv head.
    np.testing.assert_allclose(np.asarray(decode[0, 0, :, 0], np.float32), np.asarray(cache_v[0, :, 0], np.float32),
                               atol=atol)


@pytest.mark.parametrize("axis", [2, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_write_slots_moves_exact_values_and_drops_past_the_end(dtype, axis):
    shape = (2, 2, 4, 3) if axis == 2 else (2, 2, 3, 4)  # values [B, K, T, H] or keys [B, K, H, T]
    raw = jnp.zeros(shape, attention.bits_dtype(dtype))
    new = (jnp.arange(2 * 3 * 2 * 3, dtype=jnp.float32).reshape(2, 3, 2, 3) / 7).astype(dtype)  # [B, S, K, H]
    slots = jnp.asarray([[1, 2, 3], [3, 4, 5]])  # row 1: slots 4 and 5 do not exist
    out = np.asarray(attention.from_bits(attention.write_slots(raw, slots, new, dtype, axis), dtype), np.float32)
    if axis == 3:
        out = out.transpose(0, 1, 3, 2)
    expected = np.zeros((2, 2, 4, 3), np.float32)
    expected[0, :, 1:4] = np.asarray(new[0], np.float32).transpose(1, 0, 2)
    expected[1, :, 3] = np.asarray(new[1, 0], np.float32)
    np.testing.assert_array_equal(out, expected)
    assert attention.bits_dtype(dtype).itemsize == jnp.dtype(dtype).itemsize
