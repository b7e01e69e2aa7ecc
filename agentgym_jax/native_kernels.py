"""Native CPU kernels: C++ XLA FFI custom calls for the steps XLA's CPU backend runs far from the hardware's limits.

- :func:`decode_attention` (``native/decode_attention.cc``): a decode step's cache write and attention over the KV
  cache. XLA's lowering of :func:`attention.attend_one_query` copied a bf16 cache out as fp32 for every layer and
  step and read every slot of the window, and its scatter into the keys' strided layout cost more than the
  attention over a short cache; the kernel writes the new entries in place and reads each entry once, only each
  row's own slots (a decode step at batch 32 in bf16: 99 -> 82 ms on a 2-core Xeon, ``benchmarks/sampler.py``).
- :func:`amx_matmul` (``native/amx_matmul.cc``): bf16 projections of at most 32 rows (decode steps) on Intel AMX
  tiles, used by :func:`mixed_matmul.mixed_dot` where :func:`amx_matmul_applies`; only on CPUs with AMX (and an
  OS that grants it). Inside :func:`packed_projections` (the generate program's decode loop) the same products
  read weights packed once (:func:`pack_for_amx`, :func:`amx_matmul_packed`): by the sampler once per
  parameter update (:mod:`agentgym_jax.prepacked`), else by the program before its loop.
- :func:`strip_matmul` (``native/strip_matmul.cc``; bf16: ``native/bf16_gemm.cc``, ``native/pair_strips.cc``): fp32
  projections of at most 256 rows (and bf16 ones of at most 32 on CPUs with AVX512-BF16 and no AMX) inside
  :func:`packed_projections`, on weights packed once into 16-column strips (:func:`pack_strips`; AVX-512; as
  above), where :func:`strip_matmul_applies`. On AVX-512 CPUs without AVX512-BF16 (:func:`widened_bf16_available`)
  bf16 projections of up to 256 rows there, and a prefill's bf16 products of any number of rows on the sampler's
  strips, widen the bf16 weights to fp32 FMAs in registers (:func:`widened_strip_matmul`).
- :func:`bf16_gemm` (``native/bf16_gemm.cc``): bf16 products of more than 32 rows (prefill, the training forward
  pass) with AVX512-BF16 dot products, on CPUs that have them and no AMX, where :func:`bf16_gemm_applies`.
- :func:`bf16_swiglu` (``native/bf16_gemm.cc``): the MLP's gate and up products and SwiGLU in one pass while
  sampling, on the same CPUs, where :func:`bf16_swiglu_applies`.
- :func:`bf16_attention` (``native/bf16_attention.cc``): a prompt's attention in the prefill program with
  AVX512-BF16 dot products, on CPUs that have them and no AMX, where :func:`bf16_attention_applies`.
- :func:`token_pick` (``native/token_pick.cc``): a decode step's greedy pick or unfiltered draw and the picked
  token's log-probability from fp32 logits (AVX-512), where :func:`token_pick_applies`.
- :func:`amx_attention` (``native/amx_attention.cc``): bf16 attention of many queries (training rows, prompt
  prefill) on AMX tiles, forward and backward, where :func:`amx_attention_applies`.

Each source is compiled on first use, cached and registered with XLA (``agentgym_jax.native_build``). On other
backends, and under a mesh of several devices (the kernels do not split across devices), the model keeps its
pure-JAX path; ``AGENTGYM_JAX_NATIVE_KERNELS=0`` keeps it on CPU too.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np

from agentgym_jax import attention, native_build, prepacked
from agentgym_jax.native_build import (AMX_FLAGS, Kernel, amx_available, avx512_available, avx512_bf16_available,
                                       build, enabled, pair_strips_available, register, widened_bf16_available)

ENV_VAR = native_build.ENV_VAR  # the switch's name, here too for the callers of this module

AMX_MAX_ROWS = 32  # rows of x in two AMX tiles: amx_matmul takes decode-sized products only
STRIP_MAX_ROWS = 256  # fp32 decode products on packed strips (8 rows a pass over a panel that stays in L2)
AMX_BLOCK = 32  # amx_matmul's K and N must be multiples of this

DECODE_ATTENTION = Kernel("decode_attention", "AgentgymDecodeAttention", "agentgym_decode_attention")
CACHE_WRITE = Kernel("cache_write", "AgentgymCacheWrite", "agentgym_cache_write")
AMX_MATMUL = Kernel("amx_matmul", "AgentgymAmxMatmul", "agentgym_amx_matmul", AMX_FLAGS)
AMX_MATMUL_PACKED = Kernel("amx_matmul", "AgentgymAmxMatmulPacked", "agentgym_amx_matmul_packed", AMX_FLAGS)
AMX_PACK = Kernel("amx_matmul", "AgentgymAmxPack", "agentgym_amx_pack", AMX_FLAGS)
AMX_GEMM = Kernel("amx_gemm", "AgentgymAmxGemm", "agentgym_amx_gemm", AMX_FLAGS)
AMX_SWIGLU = Kernel("amx_gemm", "AgentgymAmxSwiGLU", "agentgym_amx_swiglu", AMX_FLAGS)
AMX_GEMM_PACKED = Kernel("amx_gemm", "AgentgymAmxGemmPacked", "agentgym_amx_gemm_packed", AMX_FLAGS)
AMX_SWIGLU_PACKED_ROWS = Kernel("amx_gemm", "AgentgymAmxSwiGLUPackedRows", "agentgym_amx_swiglu_packed_rows",
                                AMX_FLAGS)
AMX_SWIGLU_PACKED = Kernel("amx_matmul", "AgentgymAmxSwiGLUPacked", "agentgym_amx_swiglu_packed", AMX_FLAGS)
AMX_PACK_PAIR = Kernel("amx_matmul", "AgentgymAmxPackPair", "agentgym_amx_pack_pair", AMX_FLAGS)
AMX_ATTENTION_FORWARD = Kernel("amx_attention", "AgentgymAmxAttentionForward", "agentgym_amx_attention_forward",
                               AMX_FLAGS)
AMX_ATTENTION_BACKWARD = Kernel("amx_attention", "AgentgymAmxAttentionBackward", "agentgym_amx_attention_backward",
                                AMX_FLAGS)
STRIP_MATMUL = Kernel("strip_matmul", "AgentgymStripMatmul", "agentgym_strip_matmul")
STRIP_PACK = Kernel("strip_matmul", "AgentgymStripPack", "agentgym_strip_pack")
STRIP_MATMUL_BF16 = Kernel("bf16_gemm", "AgentgymBf16StripMatmul", "agentgym_bf16_strip_matmul")
STRIP_PACK_BF16 = Kernel("pair_strips", "AgentgymBf16StripPack", "agentgym_bf16_strip_pack")
WIDENED_STRIP_MATMUL = Kernel("pair_strips", "AgentgymWidenedStripMatmul", "agentgym_widened_strip_matmul")
BF16_GEMM = Kernel("bf16_gemm", "AgentgymBf16Gemm", "agentgym_bf16_gemm")
BF16_SWIGLU = Kernel("bf16_gemm", "AgentgymBf16SwiGLU", "agentgym_bf16_swiglu")
BF16_STRIP_SWIGLU = Kernel("bf16_gemm", "AgentgymBf16StripSwiGLU", "agentgym_bf16_strip_swiglu")
BF16_ATTENTION = Kernel("bf16_attention", "AgentgymBf16Attention", "agentgym_bf16_attention")
TOKEN_PICK = Kernel("token_pick", "AgentgymTokenPick", "agentgym_token_pick")
STRIP_LANES = 16  # strip_matmul's output count must be a multiple of this
AMX_ATTENTION_HEAD_DIM = 64  # the only head dimension amx_attention's tiles are laid out for
TARGET = DECODE_ATTENTION.target


def amx_matmul_applies(x: jax.Array, w: jax.Array, transposed: bool) -> bool:
    """Whether :func:`mixed_matmul.mixed_dot` computes ``x @ w`` (``x @ w.T`` when ``transposed``) with
    :func:`amx_matmul` in a program traced now: bf16 operands, at most :data:`AMX_MAX_ROWS` rows, K and N multiples
    of :data:`AMX_BLOCK`, native kernels enabled (:func:`enabled`) on a CPU with AMX (:func:`amx_available`)."""
    rows = int(np.prod(x.shape[:-1]))
    outputs = w.shape[0] if transposed else w.shape[-1]
    return (x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and w.ndim == 2 and 1 <= rows <= AMX_MAX_ROWS
            and x.shape[-1] % AMX_BLOCK == 0 and outputs % AMX_BLOCK == 0 and enabled() and amx_available())


def amx_matmul(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """``x @ w`` (``x @ w.T`` when ``transposed``) over ``x``'s last axis for bf16 ``x`` [..., K] (at most 32 rows)
    and ``w`` [K, N] ([N, K]), accumulated and returned in fp32 (the conditions: :func:`amx_matmul_applies`)."""
    return _rows_product(AMX_MATMUL, x, w.shape[0] if transposed else w.shape[1], w, transposed=transposed)


def _rows_product(kernel: Kernel, x: jax.Array, outputs: int, *operands: jax.Array, out_dtype: object = jnp.float32,
                  **attributes: object) -> jax.Array:
    """[..., outputs] (fp32 unless ``out_dtype``) from a product ``kernel`` run on ``x``'s rows as [M, K] and
    ``operands``: the calling convention of every projection kernel here."""
    register(kernel)
    rows = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(kernel.target, jax.ShapeDtypeStruct((rows.shape[0], outputs), out_dtype))
    return call(rows, *operands, **attributes).reshape(*x.shape[:-1], outputs)


def amx_gemm_applies(x: jax.Array, w: jax.Array, transposed: bool) -> bool:
    """Whether :func:`mixed_matmul.mixed_dot` computes ``x @ w`` with :func:`amx_gemm` in a program traced now: bf16
    operands, more than :data:`AMX_MAX_ROWS` rows, w [K, N] not transposed with K and N multiples of
    :data:`AMX_BLOCK`, native kernels enabled (:func:`enabled`) on a CPU with AMX (:func:`amx_available`)."""
    rows = int(np.prod(x.shape[:-1]))
    return (not transposed and x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and w.ndim == 2
            and rows > AMX_MAX_ROWS and x.shape[-1] % AMX_BLOCK == 0 and w.shape[1] % AMX_BLOCK == 0 and enabled()
            and amx_available())


def amx_gemm(x: jax.Array, w: jax.Array, out_dtype: object = jnp.float32) -> jax.Array:
    """``x @ w`` over ``x``'s last axis for bf16 ``x`` [..., K] of any number of rows and ``w`` [K, N], accumulated
    in fp32 on AMX tiles (32 x 32 output blocks, each panel of w reordered once per call, in groups of at most 1 MB
    per thread) and returned in fp32 or, with ``out_dtype`` bf16, rounded to it as XLA's convert would (the same
    numbers as ``amx_gemm(x, w).astype(bfloat16)``, with half the bytes written and read back)."""
    if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"amx_gemm returns fp32 or bf16, not {jnp.dtype(out_dtype)}")
    packed = prepacked.given("amx", (w,))  # the sampler's packs (a prefill): its panels without the reorder
    if packed is not None:
        return _rows_product(AMX_GEMM_PACKED, x, w.shape[1], packed, out_dtype=jnp.dtype(out_dtype))
    return _rows_product(AMX_GEMM, x, w.shape[1], w, out_dtype=jnp.dtype(out_dtype))


def bf16_gemm_applies(x: jax.Array, w: jax.Array, transposed: bool) -> bool:
    """Whether :func:`mixed_matmul.mixed_dot` computes ``x @ w`` with :func:`bf16_gemm` in a program traced now:
    where :func:`amx_gemm` would, but on a CPU with AVX512-BF16 (:func:`avx512_bf16_available`) and no AMX; K even
    and N a multiple of :data:`STRIP_LANES`."""
    rows = int(np.prod(x.shape[:-1]))
    return (not transposed and x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and w.ndim == 2
            and rows > AMX_MAX_ROWS and x.shape[-1] % 2 == 0 and w.shape[1] % STRIP_LANES == 0 and enabled()
            and avx512_bf16_available() and not amx_available())


def bf16_gemm(x: jax.Array, w: jax.Array, out_dtype: object = jnp.float32) -> jax.Array:
    """``x @ w`` over ``x``'s last axis for bf16 ``x`` [..., K] and ``w`` [K, N] with AVX512-BF16 dot products
    (pairs of k at a time, fp32 sums; 48-column panels of w packed per call), returned in fp32 or rounded to bf16
    as XLA's convert would. XLA's CPU backend converts bf16 operands to fp32 and multiplies at the fp32 rate."""
    if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"bf16_gemm returns fp32 or bf16, not {jnp.dtype(out_dtype)}")
    return _rows_product(BF16_GEMM, x, w.shape[1], w, out_dtype=jnp.dtype(out_dtype))


_packing = contextvars.ContextVar("agentgym_jax_packed_projections", default=False)


@contextlib.contextmanager
def packed_projections():
    """Within it, products that :func:`amx_matmul` would run are traced as :func:`amx_matmul_packed` of
    :func:`pack_for_amx` (w), and fp32 products of few rows as :func:`strip_matmul` of :func:`pack_strips` (w): for
    loops that run the same weights many times (the generate program's decode steps),
    whose packing XLA hoists out of the loop (tested); a single product would pay a whole pass over w to pack it."""
    token = _packing.set(True)
    try:
        yield
    finally:
        _packing.reset(token)


def packing_projections() -> bool:
    """Whether a product traced now is inside :func:`packed_projections`."""
    return _packing.get()


def packed_max_rows(dtype: object) -> int:
    """The most rows for which a decode loop's products in ``dtype`` read packed weights (more take other kernels)."""
    return STRIP_MAX_ROWS if jnp.dtype(dtype) == jnp.float32 or widened_bf16_available() else AMX_MAX_ROWS


_inference = contextvars.ContextVar("agentgym_jax_inference_only", default=False)


def traced_to_sample() -> bool:
    """Whether a program traced now is never differentiated (inside :func:`inference_only` or
    :func:`packed_projections`)."""
    return _inference.get() or packing_projections()


@contextlib.contextmanager
def inference_only():
    """Within it (and within :func:`packed_projections`), programs are traced to sample, never to be differentiated:
    the MLP's gate and up products and SwiGLU run as one kernel (:func:`amx_swiglu`), which has no gradient."""
    token = _inference.set(True)
    try:
        yield
    finally:
        _inference.reset(token)


def amx_swiglu_applies(x: jax.Array, gate: jax.Array, up: jax.Array) -> bool:
    """Whether ``silu(x @ gate) * up`` runs :func:`amx_swiglu` in a program traced now: inside
    :func:`inference_only` or :func:`packed_projections`, bf16 operands, K and N multiples of :data:`AMX_BLOCK`,
    native kernels enabled (:func:`enabled`) on a CPU with AMX (:func:`amx_available`)."""
    return ((_inference.get() or packing_projections()) and x.dtype == gate.dtype == up.dtype == jnp.bfloat16
            and gate.ndim == 2 and gate.shape == up.shape and x.shape[-1] == gate.shape[0]
            and gate.shape[0] % AMX_BLOCK == 0 and gate.shape[1] % AMX_BLOCK == 0 and enabled() and amx_available())


def bf16_swiglu_applies(x: jax.Array, gate: jax.Array, up: jax.Array) -> bool:
    """Whether ``silu(x @ gate) * up`` runs :func:`bf16_swiglu` in a program traced now: where
    :func:`amx_swiglu_applies` would but on a CPU with AVX512-BF16 and no AMX; K even, N a multiple of 16."""
    return ((_inference.get() or packing_projections()) and x.dtype == gate.dtype == up.dtype == jnp.bfloat16
            and gate.ndim == 2 and gate.shape == up.shape and x.shape[-1] == gate.shape[0] and gate.shape[0] % 2 == 0
            and gate.shape[1] % STRIP_LANES == 0 and enabled() and avx512_bf16_available() and not amx_available())


def bf16_swiglu(x: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
    """bf16 ``silu(x @ gate) * (x @ up)`` with AVX512-BF16 dot products, neither product written out (the
    conditions: :func:`bf16_swiglu_applies`): the numbers of the unfused bf16 path (each product rounded to bf16,
    silu and the product in fp32) but for rare one-ulp roundings. Inside :func:`packed_projections` a product of
    at most 32 rows reads both weights packed once (:func:`pack_strips`)."""
    rows = int(np.prod(x.shape[:-1]))
    if rows <= AMX_MAX_ROWS and packing_projections():
        return _rows_product(BF16_STRIP_SWIGLU, x, gate.shape[1], pack_strips(gate), pack_strips(up),
                             out_dtype=jnp.bfloat16)
    return _rows_product(BF16_SWIGLU, x, gate.shape[1], gate, up, out_dtype=jnp.bfloat16)


def pack_pair_for_amx(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``gate`` and ``up`` [K, N] packed as :func:`pack_for_amx` packs [K, 2N], their 32-column panels in turn
    (gate 0, up 0, gate 1, ...): :func:`amx_swiglu`'s packed operand."""
    k, n = gate.shape
    register(AMX_PACK_PAIR)
    packed = jax.ShapeDtypeStruct((2 * n // 32, k // 32, 2, 16, 16, 2), gate.dtype)
    return prepacked.packed("amx_pair", (gate, up), lambda: jax.ffi.ffi_call(AMX_PACK_PAIR.target, packed)(gate, up))


def amx_swiglu(x: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(x @ gate) * up`` in bf16 for bf16 ``x`` [..., K] and ``gate``, ``up`` [K, N] (the conditions:
    :func:`amx_swiglu_applies`): both products accumulated in fp32 on AMX tiles, rounded to bf16 and combined in
    fp32 as :func:`agentgym_jax.model.swiglu` does, in one pass that never writes either product out. Inside
    :func:`packed_projections` a product of at most 32 rows reads the panels packed once (:func:`pack_pair_for_amx`)."""
    rows = int(np.prod(x.shape[:-1]))
    if rows <= AMX_MAX_ROWS and packing_projections():
        return _rows_product(AMX_SWIGLU_PACKED, x, gate.shape[1], pack_pair_for_amx(gate, up), out_dtype=jnp.bfloat16)
    packed = prepacked.given("amx_pair", (gate, up))  # the sampler's packs (a prefill): no reorder
    if packed is not None:
        return _rows_product(AMX_SWIGLU_PACKED_ROWS, x, gate.shape[1], packed, out_dtype=jnp.bfloat16)
    return _rows_product(AMX_SWIGLU, x, gate.shape[1], gate, up, out_dtype=jnp.bfloat16)


def pack_for_amx(w: jax.Array) -> jax.Array:
    """w [K, N] (K, N multiples of 32) laid out for :func:`amx_matmul_packed`: [N/32, K/32, 2, 16, 16, 2], each
    32 x 32 block of a 32-column panel as two 16-column halves in the tiles' pair layout (two consecutive k of one
    column per 32-bit lane), the panels one after another."""
    k, n = w.shape
    register(AMX_PACK)
    packed = jax.ShapeDtypeStruct((n // 32, k // 32, 2, 16, 16, 2), w.dtype)
    return prepacked.packed("amx", (w,), lambda: jax.ffi.ffi_call(AMX_PACK.target, packed)(w))


def amx_matmul_packed(x: jax.Array, packed: jax.Array) -> jax.Array:
    """``x @ w`` for bf16 ``x`` [..., K] (at most 32 rows) and ``packed`` = :func:`pack_for_amx` (w), in fp32: each
    thread streams whole panels of w and keeps their outputs in tiles (:func:`amx_matmul` reorders every block of w
    on the fly and reads 32 rows of it at once, ~14 GB/s out of cache against ~23 here)."""
    return _rows_product(AMX_MATMUL_PACKED, x, packed.shape[0] * AMX_BLOCK, packed)


def strip_matmul_applies(x: jax.Array, w: jax.Array, transposed: bool) -> bool:
    """Whether :func:`mixed_matmul.mixed_dot` computes ``x @ w`` (``x @ w.T`` when ``transposed``) with
    :func:`strip_matmul` in a program traced now: an output count that is a multiple of :data:`STRIP_LANES`, inside
    :func:`packed_projections` or with w's strips given by the sampler (a prefill: :func:`agentgym_jax.prepacked.given`),
    native kernels enabled (:func:`enabled`), and
    fp32 operands of at most :data:`STRIP_MAX_ROWS` rows on a CPU with AVX-512 (:func:`avx512_available`); or bf16
    ones with an even K, of at most :data:`AMX_MAX_ROWS` rows on a CPU with AVX512-BF16 and no AMX (where
    :func:`amx_matmul_packed` takes them), or on an AVX-512 CPU without AVX512-BF16
    (:func:`widened_bf16_available`) of at most :data:`STRIP_MAX_ROWS` rows in a packed loop and of any number in a
    prefill."""
    rows = int(np.prod(x.shape[:-1]))
    outputs = w.shape[0] if transposed else w.shape[-1]
    if x.dtype != w.dtype or w.ndim != 2 or rows < 1 or outputs % STRIP_LANES or not enabled():
        return False
    in_loop = packing_projections()
    given = prepacked.given(_strips_kind(transposed), (w,)) is not None
    if x.dtype == jnp.float32:
        return (in_loop or given) and rows <= STRIP_MAX_ROWS and avx512_available()
    if x.dtype != jnp.bfloat16 or x.shape[-1] % 2:
        return False
    if widened_bf16_available():
        return (in_loop and rows <= STRIP_MAX_ROWS) or given
    return (in_loop or given) and rows <= AMX_MAX_ROWS and avx512_bf16_available() and not amx_available()


def _strips_kind(transposed: bool) -> str:
    """The key under which :func:`pack_strips` records (or finds) w's strips (:mod:`agentgym_jax.prepacked`)."""
    return "strips_transposed" if transposed else "strips"


def pack_strips(w: jax.Array, transposed: bool = False) -> jax.Array:
    """w [K, N] (``transposed``: [N, K]; N a multiple of 16) laid out for :func:`strip_matmul`: fp32 as [N/16, K, 16],
    strip s holding columns 16s to 16s + 15 row after row; bf16 (K even) as [N/16, K/2, 16, 2], each strip's rows
    in pairs (w[2j, c] beside w[2j + 1, c]: what an AVX512-BF16 dot product multiplies)."""
    n, k = w.shape if transposed else w.shape[::-1]
    bf16 = w.dtype == jnp.bfloat16
    kernel = STRIP_PACK_BF16 if bf16 else STRIP_PACK
    register(kernel)
    shape = (n // STRIP_LANES, k // 2, STRIP_LANES, 2) if bf16 else (n // STRIP_LANES, k, STRIP_LANES)
    call = jax.ffi.ffi_call(kernel.target, jax.ShapeDtypeStruct(shape, w.dtype))
    return prepacked.packed(_strips_kind(transposed), (w,), lambda: call(w, transposed=transposed))


def strip_matmul(x: jax.Array, packed: jax.Array) -> jax.Array:
    """``x @ w`` in fp32 for ``x`` [..., K] and ``packed`` = :func:`pack_strips` (w), both fp32 (FMAs, at most
    :data:`STRIP_MAX_ROWS` rows) or both bf16 (AVX512-BF16 dot products, ``native/bf16_gemm.cc``, at most 32 rows;
    on CPUs without them :func:`widened_strip_matmul`): each thread streams three strips at a time and keeps the
    outputs of 8 rows in registers across all of K (XLA's dots ran these products at ~10 GB/s at 8 rows, half the
    memory bandwidth)."""
    if x.dtype != packed.dtype:
        raise TypeError(f"strip_matmul needs x and the packed strips in one dtype, got {x.dtype} and {packed.dtype}")
    if x.dtype == jnp.bfloat16 and widened_bf16_available():
        return widened_strip_matmul(x, packed)
    kernel = STRIP_MATMUL_BF16 if x.dtype == jnp.bfloat16 else STRIP_MATMUL
    return _rows_product(kernel, x, packed.shape[0] * STRIP_LANES, packed)


def widened_strip_matmul(x: jax.Array, packed: jax.Array) -> jax.Array:
    """``x @ w`` in fp32 for bf16 ``x`` [..., K] (any number of rows) and ``packed`` = :func:`pack_strips` (w) in
    bf16, with fp32 FMAs on the bf16 numbers widened in registers (``native/pair_strips.cc``; AVX-512F and BW): what
    :func:`strip_matmul` runs on CPUs without AVX512-BF16, where XLA's bf16 dots ran slower than its fp32 ones."""
    if x.dtype != jnp.bfloat16 or packed.dtype != jnp.bfloat16:
        raise TypeError(f"widened_strip_matmul takes bf16 x and strips, got {x.dtype} and {packed.dtype}")
    return _rows_product(WIDENED_STRIP_MATMUL, x, packed.shape[0] * STRIP_LANES, packed)


def token_pick_applies(logits: jax.Array) -> bool:
    """Whether :func:`token_draws.draw_tokens` picks from ``logits`` with :func:`token_pick` in a program traced
    now: fp32 logits [B, V], native kernels enabled (:func:`enabled`) on a CPU with AVX-512."""
    return logits.dtype == jnp.float32 and logits.ndim == 2 and enabled() and avx512_available()


def token_pick(logits: jax.Array, temperature: jax.Array, uniform: jax.Array,
               logprob_temperature: float) -> tuple[jax.Array, jax.Array]:
    """Per row of fp32 ``logits`` [B, V]: the first maximum where ``temperature`` [B] is 0, else the inverse-CDF
    draw from ``softmax(logits / max(temperature, 1e-6))`` at the row's ``uniform`` [B] number in [0, 1); returns
    (tokens [B] int32, their log-probs under ``log_softmax(logits / logprob_temperature)``). Equals
    :func:`token_draws.draw_tokens` without filtering, up to fp32 rounding of the sums."""
    register(TOKEN_PICK)
    batch = logits.shape[0]
    call = jax.ffi.ffi_call(TOKEN_PICK.target, (jax.ShapeDtypeStruct((batch,), jnp.int32),
                                                jax.ShapeDtypeStruct((batch,), jnp.float32)))
    return call(logits, temperature.astype(jnp.float32), uniform.astype(jnp.float32),
                logprob_temperature=np.float32(logprob_temperature))


def amx_attention_applies(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether :func:`amx_attention` computes the attention of q [B, S, K, G, H] over k [B, K, H, T] and v
    [B, K, T, H] in a program traced now: bf16 operands, a head dimension of :data:`AMX_ATTENTION_HEAD_DIM`, native
    kernels enabled (:func:`enabled`) on a CPU with AMX (:func:`amx_available`)."""
    if q.ndim != 5 or k.ndim != 4 or v.ndim != 4:
        return False
    b, _, kv, _, h = q.shape
    t = k.shape[-1]
    return (h == AMX_ATTENTION_HEAD_DIM and k.shape == (b, kv, h, t) and v.shape == (b, kv, t, h)
            and all(x.dtype == jnp.bfloat16 for x in (q, k, v)) and enabled() and amx_available())


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def amx_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """Softmax attention of bf16 q [B, S, K, G, 64] over keys k [B, K, 64, T] and values v [B, K, T, 64] where
    ``allowed`` [B, S, T] (bool), on AMX tiles, with FlashAttention's backward pass (the conditions:
    :func:`amx_attention_applies`; ``allowed`` must be the full [B, S, T], not a broadcast). Equals
    :func:`attention.attend_in_blocks` up to bf16 rounding (fp32 scores and softmax; the values are multiplied by
    the bf16 unnormalized exponentials and each output divided by their fp32 sum, where the pure-JAX path rounds the
    normalized probabilities), except that a query with no allowed key gets zeros."""
    return _amx_attention_forward(q, k, v, allowed, scale)[0]


def _amx_attention_forward(q, k, v, allowed, scale):
    register(AMX_ATTENTION_FORWARD)
    b, s, kv, g, _ = q.shape
    call = jax.ffi.ffi_call(AMX_ATTENTION_FORWARD.target, (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
                                                           jax.ShapeDtypeStruct((b, kv, g, s), jnp.float32)))
    return call(q, k, v, allowed.astype(jnp.bool_), scale=np.float32(scale))


def _amx_attention_fwd(q, k, v, allowed, scale):
    out, lse = _amx_attention_forward(q, k, v, allowed, scale)
    return out, (q, k, v, allowed, out, lse)


def _amx_attention_bwd(scale, residuals, d_out):
    q, k, v, allowed, out, lse = residuals
    register(AMX_ATTENTION_BACKWARD)
    call = jax.ffi.ffi_call(AMX_ATTENTION_BACKWARD.target,
                            tuple(jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (q, k, v)))
    d_q, d_k, d_v = call(q, k, v, allowed.astype(jnp.bool_), out, lse, d_out.astype(jnp.bfloat16),
                         scale=np.float32(scale))
    return d_q, d_k, d_v, None


amx_attention.defvjp(_amx_attention_fwd, _amx_attention_bwd)


def bf16_attention_applies(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether :func:`bf16_attention` computes the attention of q [B, S, K, G, H] over k [B, K, H, T] and v
    [B, K, T, H] in a program traced now: inside :func:`inference_only` (it has no gradient), bf16 operands, H a
    multiple of 32, native kernels enabled (:func:`enabled`) on a CPU with AVX512-BF16 and no AMX."""
    if q.ndim != 5 or k.ndim != 4 or v.ndim != 4:
        return False
    b, _, kv, _, h = q.shape
    t = k.shape[-1]
    return (_inference.get() and h % 32 == 0 and k.shape == (b, kv, h, t) and v.shape == (b, kv, t, h)
            and all(x.dtype == jnp.bfloat16 for x in (q, k, v)) and enabled() and avx512_bf16_available()
            and not amx_available())


def bf16_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """Softmax attention of bf16 q [B, S, K, G, H] over keys k [B, K, H, T] and values v [B, K, T, H] where
    ``allowed`` [B, S, T] (bool), with AVX512-BF16 dot products, forward only (the conditions:
    :func:`bf16_attention_applies`). Equals :func:`attention.attend` up to bf16 rounding (fp32 scores and softmax;
    the values times the bf16 unnormalized exponentials, divided by their fp32 sum), except that a query with no
    allowed key gets zeros."""
    register(BF16_ATTENTION)
    call = jax.ffi.ffi_call(BF16_ATTENTION.target, jax.ShapeDtypeStruct(q.shape, jnp.bfloat16))
    return call(q, k, v, jnp.broadcast_to(allowed, q.shape[:2] + k.shape[-1:]).astype(jnp.bool_),
                scale=np.float32(scale))


def _check_cache_entries(kernel: str, keys: jax.Array, values: jax.Array) -> None:
    """Raises unless ``keys`` and ``values`` are both fp32 or both bf16 bits (uint16): the raw cache entries the
    native cache kernels take (:func:`attention.storage_dtype`)."""
    if keys.dtype not in (jnp.float32, jnp.uint16) or values.dtype != keys.dtype:
        raise TypeError(f"{kernel} takes fp32 or bf16-bit (uint16) caches, got {keys.dtype}/{values.dtype}")


def decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array, new_keys: jax.Array, new_values: jax.Array,
                     lengths: jax.Array, scale: float, cache_dtype: object) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's cache write and attention: writes row b's ``new_keys`` and ``new_values`` [B, 1, K, H] at slot
    ``lengths[b]`` (none past the end) of the raw cache entries keys [B, K, H, T] and values [B, K, T, H] of
    ``cache_dtype`` (fp32, or bf16 held as uint16: :func:`attention.storage_dtype`), then q [B, 1, K, G, H] attends
    over the row's first ``lengths[b] + 1`` slots (clamped to [1, T]). Returns the output [B, 1, K, G, H] in q's
    dtype (computed in fp32) and the updated keys and values (the same buffers, updated in place). Equals
    :func:`attention.write_slots` then :func:`attention.attend_one_query`."""
    _check_cache_entries("decode_attention", keys, values)
    register(DECODE_ATTENTION)
    b, _, k, g, h = q.shape
    stored = lambda x: attention.to_storage(x[:, 0].astype(cache_dtype))  # noqa: E731
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((b, k, g, h), jnp.float32),
                                     jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                                     jax.ShapeDtypeStruct(values.shape, values.dtype)),
                            input_output_aliases={1: 1, 2: 2})
    out, keys, values = call(q[:, 0].astype(jnp.float32), keys, values, stored(new_keys), stored(new_values),
                             (lengths + 1).astype(jnp.int32), scale=np.float32(scale))
    return out[:, None].astype(q.dtype), keys, values


def cache_write(keys: jax.Array, values: jax.Array, new_keys: jax.Array, new_values: jax.Array,
                starts: jax.Array, cache_dtype: object) -> tuple[jax.Array, jax.Array]:
    """Row b's ``new_keys`` and ``new_values`` [B, S, K, H] written at slots ``starts[b]`` .. ``starts[b] + S - 1``
    (none outside the cache) of the raw cache entries keys [B, K, H, T] and values [B, K, T, H] of ``cache_dtype``
    (fp32, or bf16 held as uint16), in place: :func:`attention.write_slots` at those slots."""
    _check_cache_entries("cache_write", keys, values)
    register(CACHE_WRITE)
    stored = lambda x: attention.to_storage(x.astype(cache_dtype))  # noqa: E731
    call = jax.ffi.ffi_call(CACHE_WRITE.target, (jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                                                 jax.ShapeDtypeStruct(values.shape, values.dtype)),
                            input_output_aliases={0: 0, 1: 1})
    return call(keys, values, stored(new_keys), stored(new_values), starts.astype(jnp.int32))


if __name__ == "__main__":  # `make setup`: build (or find) the libraries once
    print(build(DECODE_ATTENTION))
    print(build(CACHE_WRITE))
    if avx512_available():
        print(build(STRIP_MATMUL))
        print(build(TOKEN_PICK))
    if pair_strips_available():
        print(build(STRIP_PACK_BF16))
    if avx512_bf16_available():
        print(build(BF16_GEMM))
        print(build(BF16_ATTENTION))
    if amx_available():
        print(build(AMX_MATMUL))
        print(build(AMX_GEMM))
        print(build(AMX_ATTENTION_FORWARD))
