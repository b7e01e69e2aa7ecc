"""The decode kernel against the general one, and cache writes held as raw bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import attention, native_kernels


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
    raw = jnp.zeros(shape, attention.storage_dtype(dtype))
    new = (jnp.arange(2 * 3 * 2 * 3, dtype=jnp.float32).reshape(2, 3, 2, 3) / 7).astype(dtype)  # [B, S, K, H]
    slots = jnp.asarray([[1, 2, 3], [3, 4, 5]])  # row 1: slots 4 and 5 do not exist
    out = np.asarray(attention.from_storage(attention.write_slots(raw, slots, new, dtype, axis), dtype), np.float32)
    if axis == 3:
        out = out.transpose(0, 1, 3, 2)
    expected = np.zeros((2, 2, 4, 3), np.float32)
    expected[0, :, 1:4] = np.asarray(new[0], np.float32).transpose(1, 0, 2)
    expected[1, :, 3] = np.asarray(new[1, 0], np.float32)
    np.testing.assert_array_equal(out, expected)
    assert attention.storage_dtype(dtype) == (jnp.uint16 if jnp.dtype(dtype).itemsize == 2 else dtype)


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_never_copies_transposes_or_converts_a_whole_cache(dtype, native, monkeypatch):
    """What XLA emits for one decode step, counted: per layer, the in-place writes (scatters) of keys and values
    and, for bf16 on the pure-JAX path, one read of each into fp32; the native kernel writes and reads in place. A
    layout the attention cannot read in place, or a scatter XLA cannot run in the cache's own type, shows up here
    as more cache-sized copies, transposes or converts."""
    import re

    from flax import nnx

    from agentgym_jax.model import DecoderLM, KVCache, ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         param_dtype=dtype, dtype=dtype)
    graphdef, state = nnx.split(DecoderLM(config, nnx.Rngs(0)))

    def step(state, cache, token):
        hidden, cache = nnx.merge(graphdef, state).forward(token[:, None], cache=cache)
        return hidden, cache

    monkeypatch.setenv(native_kernels.ENV_VAR, native)
    cache = KVCache.zeros(config, 4, 40)
    hlo = jax.jit(step, donate_argnums=1).lower(state, cache, jnp.zeros((4,), jnp.int32)).compile().as_text()
    cache_shapes = {"[4,2,8,40]", "[4,2,40,8]"}  # keys, values
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[: entry.index("\n}")]  # the step's own ops (fused computations are looked into below)
    whole_cache_ops = [
        (kind, shape) for shape, kind in re.findall(r"= \w+(\[[\d,]+\])\{[^}]*\} ([\w-]+)\(", entry)
        if shape in cache_shapes
    ]
    kinds = {kind for kind, _ in whole_cache_ops}
    # the native kernel writes into the cache buffers it is handed (aliased to its outputs: read from its tuple)
    allowed_kinds = {"parameter", "bitcast"} | ({"get-tuple-element"} if native == "1" else {"scatter", "fusion"})
    assert kinds <= allowed_kinds, whole_cache_ops
    fusions = re.findall(r"= \w+(\[[\d,]+\])\{[^}]*\} fusion\(.*?calls=(%[\w.-]+)", entry)
    roots = []
    for shape, called in fusions:
        if shape in cache_shapes:
            body = hlo[hlo.index("\n" + called + " "):]
            body = body[: body.index("\n}")]
            roots.append(re.search(r"ROOT %\S+ = \S+ ([\w-]+)\(", body).group(1))
    # On the pure-JAX path each layer writes its keys and values in place (scatters), and a bf16 cache is read once
    # into fp32 for the CPU's reduction kernels (which take fp32 inputs); an fp32 cache is read where it lies.
    reads = 4 if dtype == "bfloat16" and native == "0" else 0
    writes = 0 if native == "1" else 4
    assert sorted(roots) == sorted(["scatter"] * writes + ["convert"] * reads), roots
    assert hlo.count(f'custom_call_target="{native_kernels.TARGET}"') == (2 if native == "1" else 0)


def _packed_row_problem(dtype, b=2, s=16, k=2, g=3, h=8):
    """Random q/k/v of teacher-forced rows and their mask: causal, two episodes packed in row 0."""
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(keys[0], (b, s, k, g, h)).astype(dtype)
    keys_ = jax.random.normal(keys[1], (b, k, h, s)).astype(dtype)
    values = jax.random.normal(keys[2], (b, k, s, h)).astype(dtype)
    d_out = jax.random.normal(keys[3], (b, s, k, g, h)).astype(dtype)
    blocks = jnp.stack([jnp.where(jnp.arange(s) < 6, 0, 1), jnp.zeros(s, jnp.int32)])
    segments = attention.Segments(blocks=blocks, branches=jnp.zeros((b, s), jnp.int32))
    allowed = (jnp.arange(s)[None, None, :] <= jnp.arange(s)[None, :, None]) & segments.allowed()
    return q, keys_, values, allowed, d_out


def _value_and_grads(kernel, q, k, v, allowed, d_out):
    out, pullback = jax.vjp(lambda q, k, v: kernel(q, k, v, allowed, 0.35), q, k, v)
    return (out, *pullback(d_out))


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 6e-2)])
@pytest.mark.parametrize("kernel", [
    lambda q, k, v, allowed, scale: attention.attend_in_blocks(q, k, v, allowed, scale, block=4),
    lambda q, k, v, allowed, scale: attention.attend_causal(q, k, v, allowed, scale, parts=2, block=4),
    lambda q, k, v, allowed, scale: attention.attend_causal(q, k, v, allowed, scale, parts=4, block=2),
    lambda q, k, v, allowed, scale: jax.checkpoint(
        lambda q, k, v: attention.attend_causal(q, k, v, allowed, scale, parts=2, block=4))(q, k, v),
], ids=["blocks", "causal-2-parts", "causal-4-parts", "causal-remat"])
def test_blocked_kernels_equal_the_batched_dots_and_their_gradients(kernel, dtype, atol):
    """The block kernels (a scan with FlashAttention's hand-written backward pass, and causal parts over it) give
    the output and the q/k/v gradients of :func:`attention.attend` under autodiff, on packed causal rows."""
    q, k, v, allowed, d_out = _packed_row_problem(dtype)
    expected = _value_and_grads(attention.attend, q, k, v, allowed, d_out)
    got = _value_and_grads(kernel, q, k, v, allowed, d_out)
    for name, a, e in zip(("out", "d_q", "d_k", "d_v"), got, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        scale = float(jnp.abs(e.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), atol=atol * scale,
                                   err_msg=name)


def test_causal_parts_read_only_the_keys_before_them():
    """Part 0 of a causal split never reads the later keys: changing them leaves its outputs (and their
    gradients) exactly as they were; the blocked backward pass returns no gradient to keys nobody may read."""
    q, k, v, allowed, d_out = _packed_row_problem(jnp.float32)
    kernel = lambda q, k, v, allowed, scale: attention.attend_causal(q, k, v, allowed, scale, parts=2, block=4)
    out, d_q, d_k, d_v = _value_and_grads(kernel, q, k, v, allowed, d_out.at[:, 8:].set(0.0))
    k2, v2 = k.at[..., 8:].add(5.0), v.at[:, :, 8:].add(5.0)
    out2, d_q2, _, _ = _value_and_grads(kernel, q, k2, v2, allowed, d_out.at[:, 8:].set(0.0))
    np.testing.assert_array_equal(np.asarray(out[:, :8]), np.asarray(out2[:, :8]))
    np.testing.assert_array_equal(np.asarray(d_q[:, :8]), np.asarray(d_q2[:, :8]))
    assert float(jnp.abs(d_k[..., 8:]).max()) == 0.0 and float(jnp.abs(d_v[:, :, 8:]).max()) == 0.0


def test_causal_kernel_refuses_queries_that_are_not_the_keys_slots():
    q, k, v, allowed, _ = _packed_row_problem(jnp.float32)
    with pytest.raises(ValueError, match="row's own keys"):
        attention.attend_causal(q[:, :8], k, v, allowed[:, :8], 0.35)


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_attend_over_more_queries_than_a_block_equals_a_plain_softmax(dtype, atol):
    """:func:`attention.attend` runs more than ``QUERY_BLOCK`` queries (a long prompt prefilled after cached
    tokens) one query block at a time: its output is a plain float64 softmax over the allowed keys."""
    b, s, kv, g, h, t = 2, 2 * attention.QUERY_BLOCK, 2, 3, 8, 2 * attention.QUERY_BLOCK + 64
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(keys[0], (b, s, kv, g, h)).astype(dtype)
    cache_k = jax.random.normal(keys[1], (b, kv, h, t)).astype(dtype)
    cache_v = jax.random.normal(keys[2], (b, kv, t, h)).astype(dtype)
    cached = np.array([0, 50])  # row 1's queries follow 50 cached tokens
    allowed = np.arange(t)[None, None, :] <= (cached[:, None, None] + np.arange(s)[None, :, None])
    got = np.asarray(attention.attend(q, cache_k, cache_v, jnp.asarray(allowed), 0.35), np.float32)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, cache_k, cache_v))
    scores = np.einsum("bskgh,bkht->bskgt", q64, k64) * 0.35
    scores = np.where(allowed[:, :, None, None, :], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.einsum("bskgt,bkth->bskgh", probs, v64)
    assert got.shape == (b, s, kv, g, h)
    np.testing.assert_allclose(got, expected, atol=atol * np.abs(expected).max())


def test_a_bf16_cache_reads_back_every_bit_pattern_exactly():
    """bf16 entries come back from their raw uint16 bits (widened by a shift) as the same numbers: all 65,536
    patterns, signs, infinities, subnormals and zeros included (NaNs stay NaN)."""
    bits = jnp.arange(2 ** 16, dtype=jnp.uint32).astype(jnp.uint16)
    got = np.asarray(attention.from_storage(bits, jnp.bfloat16).astype(jnp.float32))
    expected = np.asarray(jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(got, expected)
    assert np.array_equal(np.signbit(got), np.signbit(expected))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_backward_written_out_equals_autodiff_of_the_formula(dtype):
    b, s, heads, h = 2, 5, 3, 8
    x = jax.random.normal(jax.random.PRNGKey(1), (b, s, heads, h)).astype(dtype)
    positions = jnp.asarray([[0, 1, 2, 3, 4], [7, 8, 9, 30, 31]])
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    # Independent rotation in numpy: pairs (j, j + h/2) turn by position * inv_freq[j].
    angle = np.asarray(positions, np.float64)[..., None, None] * np.asarray(inv_freq, np.float64)  # [B, S, 1, H/2]
    x64 = np.asarray(x, np.float64)
    first, second = x64[..., : h // 2], x64[..., h // 2:]
    expected = np.concatenate([first * np.cos(angle) - second * np.sin(angle),
                               second * np.cos(angle) + first * np.sin(angle)], -1)
    rotated = attention.apply_rope(x, positions, inv_freq)
    assert rotated.dtype == dtype
    np.testing.assert_allclose(np.asarray(rotated, np.float64), expected, atol=1e-5 if dtype == jnp.float32 else 5e-2)

    def formula(x):  # the forward pass left to autodiff
        angles = positions[..., None].astype(jnp.float32) * inv_freq
        cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :].astype(x.dtype)
        sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :].astype(x.dtype)
        return x * cos + jnp.concatenate([-x[..., h // 2:], x[..., : h // 2]], -1) * sin

    weights = jax.random.normal(jax.random.PRNGKey(2), x.shape)
    loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x).astype(jnp.float32)) * weights)  # noqa: E731
    ours = jax.grad(loss(lambda x: attention.apply_rope(x, positions, inv_freq)))(x)
    autodiff = jax.grad(loss(formula))(x)
    assert ours.dtype == dtype
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(autodiff, np.float32))
