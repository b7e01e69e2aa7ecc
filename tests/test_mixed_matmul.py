"""mixed_dot: the same values and gradients as autodiff of a plain product, with bf16 backward products."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.mixed_matmul import mixed_dot


def _operands(x_shape=(2, 5, 16), w_shape=(16, 24), dtype=jnp.float32):
    rs = np.random.RandomState(0)
    x = jnp.asarray(rs.randn(*x_shape), dtype)
    w = jnp.asarray(rs.randn(*w_shape) * 0.1, dtype)
    weights = jnp.asarray(rs.randn(*x_shape[:-1], w_shape[1] if len(w_shape) == 2 else 0), jnp.float32)
    return x, w, weights


@pytest.mark.parametrize("transposed", [False, True])
def test_fp32_values_and_gradients_match_autodiff(transposed):
    x, w, weights = _operands()
    if transposed:
        w = w.T
    plain = lambda x, w: jnp.einsum("bsd,dn->bsn", x, w.T if transposed else w)
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)) * weights)
    ours = lambda x, w: mixed_dot(x, w, transposed=transposed)
    np.testing.assert_allclose(ours(x, w), plain(x, w), rtol=1e-6, atol=1e-6)
    for got, want in zip(jax.grad(loss(ours), (0, 1))(x, w), jax.grad(loss(plain), (0, 1))(x, w)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _dot_operand_types(fn, *args) -> list[tuple[str, str]]:
    """(lhs, rhs) element types of every dot in ``fn``'s lowered program."""
    text = jax.jit(fn).lower(*args).as_text()
    found = re.findall(r"stablehlo\.dot_general.*?:\s*\(tensor<([^>]*)>, tensor<([^>]*)>\)", text)
    assert found, "no dot in the program"
    return [(lhs.split("x")[-1], rhs.split("x")[-1]) for lhs, rhs in found]


def test_bf16_backward_products_stay_bf16_where_autodiff_mixes_in_fp32():
    x, w, weights = _operands(dtype=jnp.bfloat16)

    def grads(product):  # fp32 logits-like output, as the LM head computes
        return jax.grad(lambda x, w: jnp.sum(product(x, w) * weights), (0, 1))

    ours = grads(lambda x, w: mixed_dot(x, w, out_dtype=jnp.float32))
    plain = grads(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    assert set(_dot_operand_types(ours, x, w)) == {("bf16", "bf16")}
    assert ("f32", "f32") in set(_dot_operand_types(plain, x, w))  # autodiff's fp32 backward: what this avoids
    dx, dw = ours(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    ref_dx, ref_dw = grads(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))(
        x.astype(jnp.float32), w.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(dx, np.float32), ref_dx, rtol=0.02, atol=0.05)
    np.testing.assert_allclose(np.asarray(dw, np.float32), ref_dw, rtol=0.02, atol=0.1)


def test_mixed_operand_dtypes_are_refused():
    x, w, _ = _operands()
    with pytest.raises(TypeError, match="one dtype"):
        mixed_dot(x.astype(jnp.bfloat16), w)
