"""The AMX attention kernel (training rows and prompt prefill, forward and backward): equal to the pure-JAX
attention it replaces within bf16 rounding, no less accurate than it against fp32, and taken by a bf16 model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import attention, native_kernels
from agentgym_jax.model import DecoderLM, ModelConfig

pytestmark = pytest.mark.skipif(not native_kernels.amx_available(), reason="this CPU has no AMX bf16 tiles")
SCALE = 0.125


def _case(batch, queries, kv_heads, groups, cached=0, packed=False, seed=0):
    """bf16 q [B, S, K, G, 64], keys [B, K, 64, T], values [B, K, T, 64] and a causal ``allowed`` [B, S, T] for
    queries at slots cached..cached+S-1 (a prompt after ``cached`` cached tokens); ``packed``: two episodes per row,
    the second half of the queries blind to the first half of the keys."""
    rng = np.random.RandomState(seed)
    keys = queries + cached
    q, k, v = (jnp.asarray(rng.randn(*shape), jnp.bfloat16) for shape in (
        (batch, queries, kv_heads, groups, 64), (batch, kv_heads, 64, keys), (batch, kv_heads, keys, 64)))
    allowed = np.arange(keys)[None, :] <= np.arange(queries)[:, None] + cached
    allowed = np.repeat(allowed[None], batch, 0)
    if packed:
        allowed[:, queries // 2:, : queries // 2] = False
    d_out = jnp.asarray(rng.randn(*q.shape), jnp.bfloat16)
    return q, k, v, jnp.asarray(allowed), d_out


def _value_and_grads(attend, q, k, v, allowed, d_out):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v, allowed, SCALE).astype(jnp.float32) * d_out)  # noqa: E731
    out = jax.jit(lambda q, k, v: attend(q, k, v, allowed, SCALE))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))]


@pytest.mark.parametrize("batch,queries,kv_heads,groups,cached,packed", [
    (2, 128, 3, 3, 0, True),  # training rows: four 32-query blocks, two episodes packed per row
    (1, 40, 3, 3, 0, False),  # queries not a multiple of the tiles' 16 or 32, keys not of 32
    (2, 37, 2, 2, 50, False),  # a prompt prefilled after 50 cached tokens
    (3, 64, 1, 4, 0, False),
])
def test_kernel_equals_the_pure_jax_attention_and_its_gradients(batch, queries, kv_heads, groups, cached, packed):
    q, k, v, allowed, d_out = _case(batch, queries, kv_heads, groups, cached, packed)
    ours = _value_and_grads(native_kernels.amx_attention, q, k, v, allowed, d_out)
    pure = _value_and_grads(attention.attend_in_blocks, q, k, v, allowed, d_out)
    exact = _value_and_grads(attention.attend_in_blocks, *(x.astype(jnp.float32) for x in (q, k, v)), allowed,
                             d_out.astype(jnp.float32))
    for name, a, b, c in zip(("out", "d_q", "d_k", "d_v"), ours, pure, exact):
        assert np.abs(c).max() > 0.1, name
        # the same fp32 softmax and bf16 roundings: at most a bf16 step or two apart ...
        np.testing.assert_allclose(a, b, atol=1.6e-2 * np.abs(b).max(), err_msg=name)
        # ... and no further from the fp32 attention than the pure-JAX bf16 path is
        assert np.abs(a - c).max() <= 1.5 * np.abs(b - c).max() + 1e-3 * np.abs(c).max(), name


def test_a_query_with_no_allowed_key_gets_zeros_and_no_gradient():
    q, k, v, allowed, d_out = _case(1, 48, 2, 2)
    allowed = allowed.at[0, 20].set(False).at[0, 32:].set(False)  # a 16-query tile with no readable key at all
    out, d_q, d_k, d_v = _value_and_grads(native_kernels.amx_attention, q, k, v, allowed, d_out)
    assert not out[0, 20].any() and not out[0, 32:].any() and not d_q[0, 20].any() and not d_q[0, 32:].any()
    pure = _value_and_grads(attention.attend_in_blocks, q, k, v, allowed, d_out)[0]
    np.testing.assert_allclose(out[0, :20], pure[0, :20], atol=1.6e-2 * np.abs(pure).max())
    assert np.abs(d_k).max() > 0.1 and np.abs(d_v).max() > 0.1


def test_mismatched_shapes_take_the_pure_jax_path_or_fail_clearly():
    q, k, v, allowed, _ = _case(2, 32, 2, 2)
    assert native_kernels.amx_attention_applies(q, k, v)
    assert not native_kernels.amx_attention_applies(q, k[:1], v[:1])  # keys of another batch
    assert not native_kernels.amx_attention_applies(q, k, v[:, :, :16])  # values of fewer slots
    with pytest.raises(Exception, match="allowed \\[B, S, T\\]"):
        jax.block_until_ready(native_kernels.amx_attention(q, k, v, allowed[:1], SCALE))  # a broadcast mask


def _config(dtype: str, head_dim: int = 64) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       param_dtype=dtype, dtype=dtype)


def _kernel_calls(fn, *args) -> tuple[int, int]:
    text = jax.jit(fn).lower(*args).as_text()
    return (text.count(native_kernels.AMX_ATTENTION_FORWARD.target),
            text.count(native_kernels.AMX_ATTENTION_BACKWARD.target))


def test_a_bf16_model_trains_on_the_kernel_with_the_pure_jax_loss_and_gradients(monkeypatch):
    graphdef, state = nnx.split(DecoderLM(_config("bfloat16"), nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 128, (2, 40)))

    def loss(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens)
        return -jnp.mean(jax.nn.log_softmax(logits[:, :-1], -1)
                         [jnp.arange(2)[:, None], jnp.arange(39)[None], tokens[:, 1:]])

    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(native_kernels.ENV_VAR, setting)
        jax.clear_caches()
        assert _kernel_calls(jax.grad(loss), state, tokens) == ((2, 2) if setting == "1" else (0, 0))
        results[setting] = jax.jit(jax.value_and_grad(loss))(state, tokens)
    (ours, ours_grads), (pure, pure_grads) = results["1"], results["0"]
    assert abs(float(ours) - float(pure)) < 1e-2 * abs(float(pure))
    for a, b in zip(jax.tree.leaves(ours_grads), jax.tree.leaves(pure_grads)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=5e-2 * np.abs(b).max() + 1e-6)
    monkeypatch.setenv(native_kernels.ENV_VAR, "1")
    jax.clear_caches()
    for dtype, head_dim in (("float32", 64), ("bfloat16", 32)):  # fp32, or a head the tiles are not laid out for
        graphdef, state = nnx.split(DecoderLM(_config(dtype, head_dim), nnx.Rngs(0)))
        assert _kernel_calls(jax.grad(loss), state, tokens) == (0, 0)
