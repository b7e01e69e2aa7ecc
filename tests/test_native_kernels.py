"""The native CPU kernels (decode attention; AMX projections of few rows): equal to the pure-JAX steps they
replace, used by the sampler, and clear errors when they cannot be built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from agentgym_jax import attention, hf, native_kernels, sampling, sharding
from agentgym_jax.errors import ConfigError
from agentgym_jax.mixed_matmul import mixed_dot
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams
from tests.test_sampling import PROMPTS, _pair


def _use_native_kernels(monkeypatch, setting: str) -> None:
    """``AGENTGYM_JAX_NATIVE_KERNELS=setting`` for programs traced from now on (jit caches cleared)."""
    monkeypatch.setenv(native_kernels.ENV_VAR, setting)
    jax.clear_caches()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,kv_heads,groups,head_dim,slots", [
    (5, 2, 3, 32, 40),  # SmolLM2's 3 queries per kv head
    (3, 1, 7, 64, 70),  # 7 queries: a pass of 4 and one of 3 over the keys, two of 4 and 3 over the values
    (2, 2, 2, 136, 33),  # a head dim that is not a multiple of 16 lanes
])
def test_decode_attention_equals_write_slots_then_attend_one_query(dtype, rows, kv_heads, groups, head_dim, slots):
    rng = np.random.RandomState(0)
    keys = jnp.asarray(rng.randn(rows, kv_heads, head_dim, slots) * 2, dtype)
    values = jnp.asarray(rng.randn(rows, kv_heads, slots, head_dim), dtype)
    q = jnp.asarray(rng.randn(rows, 1, kv_heads, groups, head_dim), dtype)
    new_keys = jnp.asarray(rng.randn(rows, 1, kv_heads, head_dim) * 2, dtype)
    new_values = jnp.asarray(rng.randn(rows, 1, kv_heads, head_dim), dtype)
    # Each row writes at slot lengths[b] (none at slots or past them) and reads lengths[b] + 1 slots; past those
    # the cache holds large entries: reading them would change the output.
    lengths = jnp.asarray([0, 16, 32, slots - 1, slots + 8][:rows - 1] + [slots], jnp.int32)
    beyond = jnp.arange(slots) > lengths[:, None, None, None]
    keys = jnp.where(beyond, jnp.asarray(50, dtype), keys)
    values = jnp.where(jnp.swapaxes(beyond, 2, 3), jnp.asarray(-80, dtype), values)
    stored_keys, stored_values = attention.to_storage(keys), attention.to_storage(values)

    kernel = jax.jit(native_kernels.decode_attention, static_argnums=(6, 7))
    out, written_keys, written_values = kernel(q, stored_keys, stored_values, new_keys, new_values, lengths, 0.17,
                                               dtype)
    slots_written = lengths[:, None]
    expected_keys = attention.write_slots(stored_keys, slots_written, new_keys, dtype, attention.KEY_SLOT_AXIS)
    expected_values = attention.write_slots(stored_values, slots_written, new_values, dtype,
                                            attention.VALUE_SLOT_AXIS)
    np.testing.assert_array_equal(np.asarray(written_keys), np.asarray(expected_keys))
    np.testing.assert_array_equal(np.asarray(written_values), np.asarray(expected_values))
    allowed = (jnp.arange(slots)[None, :] < jnp.clip(lengths + 1, 1, slots)[:, None])[:, None]
    expected = attention.attend_one_query(q, attention.from_storage(expected_keys, dtype),
                                          attention.from_storage(expected_values, dtype), allowed, 0.17)

    assert out.dtype == q.dtype and out.shape == expected.shape
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=tolerance,
                               rtol=tolerance)
    # Row 0 reads slot 0 only, its new entry: its output is that value, whatever its score.
    first_slot = np.asarray(new_values[0, 0], np.float32)[:, None, :]  # [K, 1, H]
    np.testing.assert_allclose(np.asarray(out[0, 0], np.float32), np.broadcast_to(first_slot, out.shape[2:]),
                               atol=tolerance)


def test_sampler_uses_the_kernel_and_generates_what_the_pure_jax_path_does(tmp_path_factory, monkeypatch):
    _, model, _ = _pair("qwen2-gqa-untied", tmp_path_factory)
    calls = []
    kernel = native_kernels.decode_attention
    monkeypatch.setattr(native_kernels, "decode_attention", lambda *args: calls.append(1) or kernel(*args))

    def two_turns(setting):
        _use_native_kernels(monkeypatch, setting)
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
        _use_native_kernels(monkeypatch, setting)
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
        native_kernels.build(native_kernels.DECODE_ATTENTION)
    assert not (tmp_path / "native").exists() or not any((tmp_path / "native").glob("*.so"))


needs_amx = pytest.mark.skipif(not native_kernels.amx_available(), reason="this CPU has no AMX bf16 tiles")


@needs_amx
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 32, 32), (5, 576, 192), (16, 64, 96), (3, 1536, 64), (17, 64, 96),
                                       (24, 576, 192), (32, 96, 64)])
def test_amx_matmul_equals_the_fp32_accumulated_dot(rows, k, n, transposed):
    rng = np.random.RandomState(rows + k + n)
    x = jnp.asarray(rng.randn(rows, k), jnp.bfloat16)
    w = jnp.asarray(rng.randn(k, n) * 0.1, jnp.bfloat16)
    stored = w.T if transposed else w  # a tied head keeps [N, K]
    ours = np.asarray(jax.jit(native_kernels.amx_matmul, static_argnums=2)(x, stored, transposed))
    expected = np.asarray(jax.lax.dot(x, w, preferred_element_type=jnp.float32))
    assert ours.dtype == np.float32 and ours.shape == (rows, n)
    # the products of bf16 numbers are exact in fp32; only the order of the fp32 sums differs
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def _amx_calls(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count(native_kernels.AMX_MATMUL.target)


@needs_amx
def test_mixed_dot_takes_the_kernel_for_bf16_products_of_few_rows_only(monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    w = jnp.ones((64, 96), jnp.bfloat16)
    product = lambda x, w: mixed_dot(x, w)  # noqa: E731
    assert _amx_calls(product, jnp.ones((2, 8, 64), jnp.bfloat16), w) == 1
    assert _amx_calls(product, jnp.ones((2, 16, 64), jnp.bfloat16), w) == 1  # two groups of tiles
    assert _amx_calls(product, jnp.ones((33, 64), jnp.bfloat16), w) == 0  # more rows than two tiles hold
    assert _amx_calls(product, jnp.ones((2, 64), jnp.float32), w.astype(jnp.float32)) == 0
    assert _amx_calls(lambda x, w: mixed_dot(x, w, transposed=True), jnp.ones((2, 96), jnp.bfloat16), w) == 1
    assert _amx_calls(product, jnp.ones((2, 48), jnp.bfloat16), jnp.ones((48, 96), jnp.bfloat16)) == 0  # K % 32
    _use_native_kernels(monkeypatch, "0")
    assert _amx_calls(product, jnp.ones((2, 64), jnp.bfloat16), w) == 0

    assert_same_gradients_with_and_without_kernels(monkeypatch, (4, 64))


def assert_same_gradients_with_and_without_kernels(monkeypatch, x_shape: tuple[int, ...]) -> None:
    """The gradients of a bf16 mixed_dot of x [*x_shape] and w [64, 96] stay XLA products: equal with the native
    kernels on and off."""
    rng = np.random.RandomState(0)
    x, w = (jnp.asarray(rng.randn(*shape), jnp.bfloat16) for shape in (x_shape, (64, 96)))
    loss = lambda x, w: jnp.sum(mixed_dot(x, w).astype(jnp.float32) ** 2)  # noqa: E731
    grads = {}
    for setting in ("1", "0"):
        _use_native_kernels(monkeypatch, setting)
        grads[setting] = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    for ours, reference in zip(grads["1"], grads["0"]):
        np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(reference, np.float32), rtol=2e-2)


def assert_a_bf16_prompt_runs_its_projections_on(applies_name: str, target: str, tmp_path_factory,
                                                  monkeypatch) -> None:
    """A bf16 prompt of 80 rows takes the many-rows product kernel whose gate is ``native_kernels.<applies_name>``
    (XLA target ``target``) for all 15 projections (2 layers x q, k, v, o, gate, up, down, and the untied head),
    with the pure-JAX logits; with that gate off, none (every other kernel runs in both)."""
    _, _, model_dir = _pair("qwen2-gqa-untied", tmp_path_factory)
    graphdef, state = nnx.split(hf.load_model(model_dir, param_dtype="bfloat16", dtype="bfloat16"))
    forward = lambda state, tokens: nnx.merge(graphdef, state)(tokens)  # noqa: E731
    tokens = jnp.asarray(np.random.RandomState(1).randint(3, 250, (2, 40)))
    applies, logits = getattr(native_kernels, applies_name), {}
    _use_native_kernels(monkeypatch, "1")
    for on in (True, False):
        monkeypatch.setattr(native_kernels, applies_name, lambda *a, on=on: on and applies(*a))
        jax.clear_caches()
        assert jax.jit(forward).lower(state, tokens).as_text().count(f"@{target}(") == (15 if on else 0)
        logits[on] = np.asarray(jax.jit(forward)(state, tokens), np.float32)
    assert np.abs(logits[False]).max() > 0.1
    np.testing.assert_allclose(logits[True], logits[False], atol=1e-2 * np.abs(logits[False]).max())


@needs_amx
def test_a_bf16_model_runs_its_projections_on_the_kernel_with_the_pure_jax_logits(tmp_path_factory, monkeypatch):
    _, _, model_dir = _pair("qwen2-gqa-untied", tmp_path_factory)
    graphdef, state = nnx.split(hf.load_model(model_dir, param_dtype="bfloat16", dtype="bfloat16"))
    forward = lambda state, tokens: nnx.merge(graphdef, state)(tokens)  # noqa: E731
    tokens = jnp.asarray([[5, 9, 17, 33, 2, 8, 100, 7]])
    logits = {}
    for setting in ("1", "0"):
        _use_native_kernels(monkeypatch, setting)
        logits[setting] = np.asarray(jax.jit(forward)(state, tokens), np.float32)
        # 2 layers x (q, k, v, o, gate, up, down) and the untied head, on 8 rows each
        assert _amx_calls(forward, state, tokens) == (15 if setting == "1" else 0)
    assert np.abs(logits["1"]).max() > 0.1
    np.testing.assert_allclose(logits["1"], logits["0"], atol=2e-2 * np.abs(logits["0"]).max())
    _use_native_kernels(monkeypatch, "1")
    # a prompt of 33 tokens: amx_gemm instead (tests/test_amx_gemm.py)
    assert _amx_calls(forward, state, jnp.ones((1, 33), jnp.int32)) == 0


@needs_amx
@pytest.mark.parametrize("rows,k,n", [(1, 32, 32), (8, 576, 192), (17, 64, 96), (32, 1536, 64)])
def test_packed_weights_give_the_unpacked_kernels_products_exactly(rows, k, n):
    rng = np.random.RandomState(rows + k + n)
    x = jnp.asarray(rng.randn(rows, k), jnp.bfloat16)
    w = jnp.asarray(rng.randn(k, n) * 0.1, jnp.bfloat16)
    packed = np.asarray(jax.jit(native_kernels.pack_for_amx)(w)).view(np.uint16)
    bits = np.asarray(w).view(np.uint16)
    # panel p, k block b, half h, pair row r, lane c, j: w[32 b + 2 r + j, 32 p + 16 h + c]
    expected = bits.reshape(k // 32, 16, 2, n // 32, 2, 16).transpose(3, 0, 4, 1, 5, 2)
    np.testing.assert_array_equal(packed, expected)
    ours = jax.jit(lambda x, w: native_kernels.amx_matmul_packed(x, native_kernels.pack_for_amx(w)))(x, w)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(jax.jit(native_kernels.amx_matmul)(x, w)))


@needs_amx
def test_a_loop_packs_its_weights_once_before_it_and_a_single_product_not_at_all(monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    w = jnp.asarray(np.random.RandomState(0).randn(64, 64) * 0.1, jnp.bfloat16)

    def steps(x, w):
        with native_kernels.packed_projections():
            return jax.lax.fori_loop(0, 4, lambda i, x: mixed_dot(x, w), x)

    hlo = jax.jit(steps).lower(jnp.ones((8, 64), jnp.bfloat16), w).compile().as_text()
    body = next(part for part in hlo.split("\n\n") if native_kernels.AMX_MATMUL_PACKED.target in part)
    assert native_kernels.AMX_PACK.target not in body  # the product is in the loop body, its packing is not
    assert hlo.count(f'custom_call_target="{native_kernels.AMX_PACK.target}"') == 1
    assert _amx_calls(lambda x, w: mixed_dot(x, w), jnp.ones((8, 64), jnp.bfloat16), w) == 1  # unpacked kernel
    assert native_kernels.AMX_PACK.target not in jax.jit(lambda x, w: mixed_dot(x, w)).lower(
        jnp.ones((8, 64), jnp.bfloat16), w).as_text()


@needs_amx
def test_bf16_sampling_on_packed_weights_gives_the_unpacked_kernels_tokens(tmp_path_factory, monkeypatch):
    _use_native_kernels(monkeypatch, "1")
    _, _, model_dir = _pair("qwen2-gqa-untied", tmp_path_factory)
    model = hf.load_model(model_dir, param_dtype="bfloat16", dtype="bfloat16")
    program, compiled = sampling._generate_program, []
    monkeypatch.setattr(sampling, "_generate_program", lambda *a, **k: compiled.append(
        program.lower(*a, **k).compile().as_text()) or program(*a, **k))
    outputs, samplers = [], []
    for packing in (True, False):
        monkeypatch.setattr(native_kernels, "packing_projections", lambda packing=packing: packing)
        jax.clear_caches()
        sampler = Sampler(model, SamplerConfig(cache_length=64))
        samplers.append(sampler)
        _, out = sampler.generate(sampler.new_state(2), [[7] * 20 + [5], [9] * 25 + [6]], jax.random.PRNGKey(0),
                                  SamplingParams(temperature=1.0, max_new_tokens=8))
        outputs.append(out)
    # the decode loop reads weights packed once per parameter update (the sampler's pack program): none packed in
    # the generate program
    packed_product = native_kernels.AMX_MATMUL_PACKED.target
    body = next(part for part in compiled[0].split("\n\n") if packed_product in part)
    calls = lambda text, kernel: text.count(f'custom_call_target="{kernel.target}"')  # noqa: E731
    for pack in (native_kernels.AMX_PACK, native_kernels.AMX_PACK_PAIR):
        assert calls(compiled[0], pack) == 0 and calls(compiled[1], pack) == 0
    # 2 layers x (q, k, v, o, down) and the untied head, and the gate and up packed together for the fused SwiGLU
    kinds = [key.split(":")[0] for key in samplers[0]._packed]
    assert (kinds.count("amx"), kinds.count("amx_pair")) == (2 * 5 + 1, 2) and samplers[1]._packed == {}
    assert calls(body, native_kernels.AMX_SWIGLU_PACKED) == 2
    assert outputs[0].tokens == outputs[1].tokens and len(outputs[0].tokens[0]) == 8
    for a, b in zip(outputs[0].logprobs, outputs[1].logprobs):
        np.testing.assert_array_equal(a, b)
