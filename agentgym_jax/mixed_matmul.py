"""Matrix products in the compute dtype with fp32 accumulation, in the backward pass too.

Every projection computes ``dot(x, w, preferred_element_type=float32)``. Left to autodiff, the backward pass gets
the fp32 cotangent of that product and multiplies it with the bf16 operands: a mixed-dtype product, which XLA runs
entirely in fp32. On a GPU that meant TF32 GEMMs for two thirds of a train step's matmul FLOPs (the gradients
of inputs and weights; 43% of an H200 step's GPU time, ``benchmarks/gpu_check``). :func:`mixed_dot` casts the
cotangent to the operands' dtype first, as mixed-precision training does in torch's autocast, so both backward
products are bf16 x bf16 with fp32 accumulation. With fp32 operands nothing changes.

On CPUs with AMX, a bf16 product of at most 32 rows (a decode step's projections) runs
:func:`native_kernels.amx_matmul` instead of XLA's dot (:func:`native_kernels.amx_matmul_applies`), or, inside
:func:`native_kernels.packed_projections` (the generate program's decode loop), :func:`native_kernels.amx_matmul_packed`
on weights packed once per parameter update (:mod:`agentgym_jax.prepacked`); its gradients stay XLA products. In
fp32, products of at most 256 rows inside :func:`native_kernels.packed_projections` run
:func:`native_kernels.strip_matmul` on weights packed into strips (:func:`native_kernels.strip_matmul_applies`).
bf16 products of more than 32 rows (prompt prefill, the training forward pass) run :func:`native_kernels.amx_gemm`
(:func:`native_kernels.amx_gemm_applies`), or on CPUs with AVX512-BF16 and no AMX :func:`native_kernels.bf16_gemm`,
and bf16 products of at most 32 rows inside :func:`native_kernels.packed_projections` there run
:func:`native_kernels.strip_matmul` as fp32 ones do. On AVX-512 CPUs without AVX512-BF16, bf16 products on the
sampler's strips (the decode loop's, and its prefill's of any number of rows) run
:func:`native_kernels.widened_strip_matmul`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax import native_kernels


def _contract(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    """fp32 ``x @ w`` (``x @ w.T`` when ``transposed``) over ``x``'s last axis."""
    if native_kernels.strip_matmul_applies(x, w, transposed):
        return native_kernels.strip_matmul(x, native_kernels.pack_strips(w, transposed))
    if native_kernels.amx_gemm_applies(x, w, transposed):
        return native_kernels.amx_gemm(x, w)
    if native_kernels.bf16_gemm_applies(x, w, transposed):
        return native_kernels.bf16_gemm(x, w)
    if native_kernels.amx_matmul_applies(x, w, transposed):
        if not transposed and native_kernels.packing_projections():
            return native_kernels.amx_matmul_packed(x, native_kernels.pack_for_amx(w))
        return native_kernels.amx_matmul(x, w, transposed)
    w_axis = 1 if transposed else 0
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (w_axis,)), ((), ())), preferred_element_type=jnp.float32)


def _product(x: jax.Array, w: jax.Array, transposed: bool, out_dtype: np.dtype) -> jax.Array:
    if out_dtype == jnp.bfloat16 and native_kernels.amx_gemm_applies(x, w, transposed):
        return native_kernels.amx_gemm(x, w, out_dtype)  # rounded in the kernel: no fp32 [M, N] in memory
    if out_dtype == jnp.bfloat16 and native_kernels.bf16_gemm_applies(x, w, transposed):
        return native_kernels.bf16_gemm(x, w, out_dtype)
    return _contract(x, w, transposed).astype(out_dtype)


_mixed_dot = partial(jax.custom_vjp, nondiff_argnums=(2, 3))(_product)


def _forward(x, w, transposed, out_dtype):
    return _mixed_dot(x, w, transposed, out_dtype), (x, w)


def _backward(transposed, out_dtype, residuals, cotangent):
    x, w = residuals
    g = cotangent.astype(x.dtype)  # the product's inputs were in x's dtype: so are its gradients' products
    out_axis = 0 if transposed else 1  # w's output-feature axis
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (out_axis,)), ((), ())), preferred_element_type=jnp.float32)
    leading = tuple(range(x.ndim - 1))
    if transposed:  # dw [N, K] = g^T x
        dw = jax.lax.dot_general(g, x, ((leading, leading), ((), ())), preferred_element_type=jnp.float32)
    else:  # dw [K, N] = x^T g
        dw = jax.lax.dot_general(x, g, ((leading, leading), ((), ())), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_mixed_dot.defvjp(_forward, _backward)


def mixed_dot(x: jax.Array, w: jax.Array, *, transposed: bool = False, out_dtype: object = None) -> jax.Array:
    """``x @ w`` (``x @ w.T`` when ``transposed``) over ``x``'s last axis, accumulated in fp32 and returned in
    ``out_dtype`` (default ``x``'s); the gradients' products run in ``x``'s dtype with fp32 accumulation too.
    ``x`` and ``w`` must share a dtype (cast ``w`` to the compute dtype first)."""
    if x.dtype != w.dtype:
        raise TypeError(f"mixed_dot needs operands of one dtype, got {x.dtype} and {w.dtype}")
    if native_kernels.traced_to_sample():  # never differentiated: w reaches its packing (or its packs) as itself
        return _product(x, w, transposed, np.dtype(out_dtype or x.dtype))  # (agentgym_jax.prepacked)
    return _mixed_dot(x, w, transposed, np.dtype(out_dtype or x.dtype))
