"""The MLP's gate and up products and SwiGLU in one pass: on AMX tiles (``amx_swiglu`` in ``native/amx_gemm.cc``
and, packed, ``native/amx_matmul.cc``) or, on CPUs with AVX512-BF16 and no AMX, with its dot products
(``bf16_swiglu`` in ``native/bf16_gemm.cc``): the unfused bf16 path's numbers, taken only in programs that
sample."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from agentgym_jax import hf, native_kernels
from agentgym_jax.model import swiglu
from tests.test_native_kernels import _use_native_kernels
from tests.test_sampling import _pair


@dataclass(frozen=True)
class Fused:
    """One fused kernel family: its names in native_kernels and the XLA targets of its unpacked and packed calls."""

    name: str
    unpacked: str
    packed: str

    def applies(self, *args) -> bool:
        return getattr(native_kernels, f"{self.name}_applies")(*args)

    def __call__(self, *args) -> jax.Array:
        return getattr(native_kernels, self.name)(*args)


FAMILIES = [
    pytest.param(Fused("amx_swiglu", native_kernels.AMX_SWIGLU.target, native_kernels.AMX_SWIGLU_PACKED.target),
                 marks=pytest.mark.skipif(not native_kernels.amx_available(), reason="this CPU has no AMX bf16 tiles"),
                 id="amx"),
    pytest.param(Fused("bf16_swiglu", native_kernels.BF16_SWIGLU.target, native_kernels.BF16_STRIP_SWIGLU.target),
                 marks=pytest.mark.skipif(
                     not native_kernels.avx512_bf16_available() or native_kernels.amx_available(),
                     reason="this CPU has no AVX512-BF16, or has AMX (amx_swiglu fuses there)"),
                 id="avx512_bf16"),
]


def _unfused(x: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The model's bf16 path in pure JAX: each product accumulated in fp32 and rounded to bf16, then SwiGLU."""
    product = lambda w: jax.lax.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    return swiglu(product(gate), product(up))


@pytest.mark.parametrize("family", FAMILIES)
# 160 outputs (AVX512-BF16: three panels of 48 and one of 16); 17 rows (its passes of 8, 8 and 1)
@pytest.mark.parametrize("rows,packed", [(1, True), (17, True), (32, True), (33, False), (100, False), (5, False)])
def test_the_fused_pass_gives_the_unfused_numbers(family, rows, packed, monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    rng = np.random.RandomState(rows)
    x = jnp.asarray(rng.randn(rows, 96), jnp.bfloat16)
    gate, up = (jnp.asarray(rng.randn(96, 160) * 0.2, jnp.bfloat16) for _ in range(2))

    def fused(x, gate, up):
        with native_kernels.packed_projections() if packed else native_kernels.inference_only():
            assert family.applies(x, gate, up)
            return family(x, gate, up)

    target = family.packed if packed else family.unpacked
    assert f"@{target}(" in jax.jit(fused).lower(x, gate, up).as_text()
    ours = np.asarray(jax.jit(fused)(x, gate, up), np.float32)
    expected = np.asarray(jax.jit(_unfused)(x, gate, up), np.float32)
    assert ours.shape == (rows, 160) and np.abs(expected).max() > 1.0
    # fp32 sums in another order and another sigmoid: an element may round to the neighbouring bf16 number
    assert np.mean(ours != expected) < 0.01
    np.testing.assert_allclose(ours, expected, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mlp_fuses_only_in_programs_that_sample(family, tmp_path_factory, monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    _, _, model_dir = _pair("qwen2-gqa-untied", tmp_path_factory)
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 250, (2, 40)))

    def fused_calls(model, context) -> int:
        graphdef, state = nnx.split(model)

        def forward(state, tokens):
            with context():
                return nnx.merge(graphdef, state)(tokens)

        return jax.jit(forward).lower(state, tokens).as_text().count(f"@{family.unpacked}(")

    model = hf.load_model(model_dir, param_dtype="bfloat16", dtype="bfloat16")
    assert fused_calls(model, native_kernels.inference_only) == 2  # 2 layers
    assert fused_calls(model, lambda: jax.named_scope("training")) == 0  # a program that may be differentiated
    adapted = hf.load_model(model_dir, param_dtype="bfloat16", dtype="bfloat16", lora_rank=4,
                            lora_targets=("gate_proj", "up_proj"))
    assert fused_calls(adapted, native_kernels.inference_only) == 0  # the adapters' products must run
    assert fused_calls(hf.load_model(model_dir), native_kernels.inference_only) == 0  # fp32

    graphdef, state = nnx.split(model)
    logits = {}
    for fuse in (True, False):
        def forward(state, tokens, fuse=fuse):
            with native_kernels.inference_only() if fuse else jax.named_scope("plain"):
                return nnx.merge(graphdef, state)(tokens)
        logits[fuse] = np.asarray(jax.jit(forward)(state, tokens), np.float32)
    assert np.abs(logits[False]).max() > 0.1
    np.testing.assert_allclose(logits[True], logits[False], atol=1e-2 * np.abs(logits[False]).max())
