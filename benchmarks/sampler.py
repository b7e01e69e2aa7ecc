"""Sampler benchmark: our jitted sampler vs transformers ``generate`` on SmolLM2-135M-Instruct, same run.

Measures generated tokens/s (end to end: prefill + 64 greedy tokens, no early stop) at batch 1, 8 and 32 with
~200-token prompts, fp32 and bf16 for both; compile time apart from steady state; decode step time beside its
roofline (the larger of the memory-bandwidth bound and the compute bound at the measured matmul peak), and with
the pure-JAX steps in place of the native kernels (``agentgym_jax/native_kernels.py``: all of them off, and the
AMX projections alone off); a
multi-turn rollout with KV-cache extend vs re-prefilling the history each turn; which matmul paths XLA and
torch take on this CPU; peak RSS. Ours and torch are timed interleaved (the machine
is shared), medians of the repeats. Writes ``benchmarks/results/sampler.json``.

Usage: python -m benchmarks.sampler [--repeats=3] [--repeats_b32=3] [--multiturn_batch=4]
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from absl import app, flags

from agentgym_jax import compile_stats, hf, native_kernels
from agentgym_jax.default_model import prepare_default_model
from agentgym_jax.model import KVCache
from agentgym_jax.sampling import PROGRAM_NAME, Sampler, SamplerConfig, SamplingParams
from benchmarks import common

_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per case at batch 1 and 8 (after a warm-up run).")
_REPEATS_B32 = flags.DEFINE_integer("repeats_b32", 3, "Timed runs per case at batch 32.")
_MULTITURN_BATCH = flags.DEFINE_integer("multiturn_batch", 4, "Episodes in the multi-turn case.")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Batch sizes.")

PROMPT_TOKENS, NEW_TOKENS = 200, 64
TURNS, OBS_TOKENS, TURN_TOKENS = 8, 64, 32
WINDOW_BUCKETS = (128, 256, 384, 512, 768, 1024, 1536)
DTYPES = ("float32", "bfloat16")


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(100, 40000, length).tolist() for _ in range(batch)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n)


def _ours_run(sampler: Sampler, prompts: list[list[int]], n: int, release_packed: bool = False) -> float:
    state = sampler.new_state(len(prompts))
    if release_packed:
        sampler.release_packed()
    start = time.perf_counter()
    _, result = sampler.generate(state, prompts, jax.random.PRNGKey(0), _greedy(n))
    seconds = time.perf_counter() - start
    if any(len(t) != n for t in result.tokens):
        raise RuntimeError("a row stopped early; the benchmark needs exactly n tokens per row")
    return seconds


def _torch_run(model: Any, prompts: list[list[int]], n: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=[-1],
            pad_token_id=2, use_cache=True,
        )
    seconds = time.perf_counter() - start
    if out.shape[1] - ids.shape[1] != n:
        raise RuntimeError("transformers generated fewer tokens than asked")
    return seconds


def matmul_paths() -> dict[str, Any]:
    """Which kernels a bf16 matmul uses: XLA's optimized HLO with a bf16 result and with the fp32 result our
    layers ask for (``preferred_element_type``), torch's oneDNN (mkldnn) support."""
    a = jnp.ones((64, 576), jnp.bfloat16)
    b = jnp.ones((576, 1536), jnp.bfloat16)

    def dots(fn: Any) -> list[str]:
        hlo = fn.lower(a, b).compile().as_text()
        return [line.strip() for line in hlo.splitlines() if " dot(" in line or "custom-call" in line
                or "convert(" in line]

    bf16_result = dots(jax.jit(lambda x, y: x @ y))
    f32_result = dots(jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)))
    upcast = lambda lines: any("convert(" in line and "f32" in line.split("=")[1][:12] for line in lines)
    return {
        "xla_bf16_result_hlo": bf16_result[:4],
        "xla_bf16_result_upcasts_operands": upcast(bf16_result),
        "xla_f32_result_hlo": f32_result[:4],
        "xla_f32_result_upcasts_operands": upcast(f32_result),
        "torch_mkldnn_available": bool(torch.backends.mkldnn.is_available()),
        "torch_mkldnn_bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "torch_threads": torch.get_num_threads(),
    }


def decode_bound(config: Any, dtype: str, batch: int, mean_length: float, bandwidth_gbs: float,
                 matmul_flops: float) -> dict[str, float]:
    """A decode step's roofline: the time to read its bytes (all weights + the live KV slots) at the measured
    bandwidth, and the time to compute its FLOPs (every weight matmul and the attention over the live slots, per
    row) at the measured peak of a large matmul; the bound is the larger of the two."""
    itemsize = 2 if dtype == "bfloat16" else 4
    weight_bytes = config.num_params() * itemsize
    cache_bytes = KVCache.nbytes(config, batch, int(mean_length), dtype)
    attention_flops = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * mean_length
    flops = batch * (2 * config.num_params() + attention_flops)
    bandwidth_ms = 1000 * (weight_bytes + cache_bytes) / (bandwidth_gbs * 1e9)
    compute_ms = 1000 * flops / matmul_flops
    step_ms = max(bandwidth_ms, compute_ms)
    return {"bytes_per_step": weight_bytes + cache_bytes, "bandwidth_bound_step_ms": bandwidth_ms,
            "flops_per_step": flops, "compute_bound_step_ms": compute_ms, "bound_step_ms": step_ms,
            "bound_tokens_per_s": 1000 * batch / step_ms}


def single_turn(ours: dict, theirs: dict, batch: int, repeats: int, bandwidth: float,
                peaks: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    prompts = _prompts(batch, PROMPT_TOKENS, batch)
    for dtype in DTYPES:
        sampler = Sampler(ours[dtype], SamplerConfig(cache_length=512, window_buckets=WINDOW_BUCKETS,
                                                     new_token_buckets=(1, 64)))
        compiles = compile_stats.compile_seconds(PROGRAM_NAME)
        first = _ours_run(sampler, prompts, NEW_TOKENS)
        compile_s = compile_stats.compile_seconds(PROGRAM_NAME) - compiles
        torch_first = _torch_run(theirs[dtype], prompts, NEW_TOKENS)
        ours_s, torch_s = [], []
        for _ in range(repeats):  # interleaved: both see the same machine load
            ours_s.append(_ours_run(sampler, prompts, NEW_TOKENS))
            torch_s.append(_torch_run(theirs[dtype], prompts, NEW_TOKENS))
        row = dict(
            batch=batch, dtype=dtype, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS,
            ours_seconds=common.median(ours_s), torch_seconds=common.median(torch_s),
            ours_tokens_per_s=batch * NEW_TOKENS / common.median(ours_s),
            torch_tokens_per_s=batch * NEW_TOKENS / common.median(torch_s),
            ours_first_call_seconds=first, ours_compile_seconds=compile_s, torch_first_call_seconds=torch_first,
            ours_runs=ours_s, torch_runs=torch_s,
        )
        row["ratio"] = row["ours_tokens_per_s"] / row["torch_tokens_per_s"]
        # a call right after a parameter update packs the decode loop's weights again (once per update)
        row["ours_seconds_after_update"] = common.median(
            [_ours_run(sampler, prompts, NEW_TOKENS, release_packed=True) for _ in range(2)])
        # decode step time from a prefill-only run, beside the roofline
        _ours_run(sampler, prompts, 1)
        prefill = common.median([_ours_run(sampler, prompts, 1) for _ in range(2)])
        step_ms = 1000 * (row["ours_seconds"] - prefill) / (NEW_TOKENS - 1)
        row.update(ours_prefill_seconds=prefill, ours_decode_step_ms=step_ms,
                   **decode_bound(ours[dtype].config, dtype, batch, PROMPT_TOKENS + NEW_TOKENS / 2, bandwidth,
                                peaks[dtype]))
        row["decode_vs_bound"] = step_ms / row["bound_step_ms"]
        # the same calls with XLA's dots in place of the AMX projections, and with every native kernel off
        # (each with its own prefill-only time: the AMX kernel also takes a prompt's last chunk of 16 positions)
        for name, switch in (("xla_dots", _without_amx), ("pure_jax", common.without_native_kernels)):
            with switch():
                seconds, prefill_seconds = _fresh_seconds(ours[dtype], sampler.config, prompts)
            row.update({f"ours_seconds_{name}": seconds, f"ours_prefill_seconds_{name}": prefill_seconds,
                        f"ours_decode_step_ms_{name}": 1000 * (seconds - prefill_seconds) / (NEW_TOKENS - 1)})
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if not k.endswith("runs")},
              flush=True)
        rows.append(row)
    return rows


@contextlib.contextmanager
def _without_amx() -> Iterator[None]:
    """Programs traced inside take XLA's dots for the projections: no AMX and no AVX512-BF16 products (bf16), no
    packed strips (fp32, and bf16 without AMX); the attention, cache-write and token-pick kernels stay."""
    names = ("amx_matmul_applies", "amx_gemm_applies", "amx_swiglu_applies", "strip_matmul_applies",
             "bf16_gemm_applies", "bf16_swiglu_applies")
    saved = {name: getattr(native_kernels, name) for name in names}
    for name in names:
        setattr(native_kernels, name, lambda *args: False)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(native_kernels, name, value)


def _fresh_seconds(model: Any, config: SamplerConfig, prompts: list[list[int]]) -> tuple[float, float]:
    """Median seconds of a generate call of 64 tokens and of a prefill-only (1-token) call, on programs traced
    anew (caches cleared before and after)."""
    try:
        jax.clear_caches()
        sampler = Sampler(model, config)
        _ours_run(sampler, prompts, NEW_TOKENS)  # builds the programs
        _ours_run(sampler, prompts, 1)
        full = common.median([_ours_run(sampler, prompts, NEW_TOKENS) for _ in range(2)])
        return full, common.median([_ours_run(sampler, prompts, 1) for _ in range(2)])
    finally:
        jax.clear_caches()


def multi_turn(model: Any, batch: int) -> dict[str, Any]:
    """8 turns of (+64 observation tokens, 32 generated): extend the cache vs re-prefill the whole history."""
    rng = np.random.RandomState(7)
    first = _prompts(batch, PROMPT_TOKENS, 99)
    observations = [[rng.randint(100, 40000, OBS_TOKENS).tolist() for _ in range(batch)] for _ in range(TURNS)]
    config = SamplerConfig(cache_length=1024, window_buckets=WINDOW_BUCKETS)
    params = _greedy(TURN_TOKENS)

    def extend() -> float:
        sampler = Sampler(model, config)
        state, new = sampler.new_state(batch), first
        start = time.perf_counter()
        for turn in range(TURNS):
            state, result = sampler.generate(state, new, jax.random.PRNGKey(turn), params)
            new = observations[turn]
        return time.perf_counter() - start

    def reprefill() -> float:
        sampler = Sampler(model, config)
        history = [list(p) for p in first]
        start = time.perf_counter()
        for turn in range(TURNS):
            _, result = sampler.generate(sampler.new_state(batch), history, jax.random.PRNGKey(turn), params)
            history = [h + t + o for h, t, o in zip(history, result.tokens, observations[turn])]
        return time.perf_counter() - start

    out: dict[str, Any] = dict(batch=batch, turns=TURNS, obs_tokens=OBS_TOKENS, generated_per_turn=TURN_TOKENS,
                               prompt_tokens=PROMPT_TOKENS, dtype=model.config.dtype)
    for name, fn in (("extend", extend), ("reprefill", reprefill)):
        before = compile_stats.compile_seconds(PROGRAM_NAME)
        compiles_before = compile_stats.compilations(PROGRAM_NAME)
        first_s = fn()
        out[f"{name}_first_seconds"] = first_s
        out[f"{name}_compile_seconds"] = compile_stats.compile_seconds(PROGRAM_NAME) - before
        out[f"{name}_programs_compiled"] = compile_stats.compilations(PROGRAM_NAME) - compiles_before
        out[f"{name}_seconds"] = fn()
        print(name, {k: round(v, 2) for k, v in out.items() if k.startswith(name)}, flush=True)
    out["ratio"] = out["reprefill_seconds"] / out["extend_seconds"]
    return out


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    compile_stats.install()
    wall = time.perf_counter()
    from transformers import AutoModelForCausalLM

    model_dir = prepare_default_model()
    bandwidth = common.memory_bandwidth_gbs()
    peaks = {d: common.matmul_flops_per_s(d) for d in DTYPES}
    ours = {d: hf.load_model(model_dir, param_dtype=d, dtype=d) for d in DTYPES}
    theirs = {d: AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, d)).eval() for d in DTYPES}
    paths = matmul_paths()
    print(paths, flush=True)
    table = []
    for batch in [int(b) for b in _BATCHES.value]:
        table += single_turn(ours, theirs, batch, _REPEATS_B32.value if batch >= 32 else _REPEATS.value, bandwidth,
                             peaks)
    multiturn = multi_turn(ours["float32"], _MULTITURN_BATCH.value)

    def best_ratio(batch: int) -> float | None:
        rows = [r for r in table if r["batch"] == batch]
        if not rows:
            return None
        return max(r["ours_tokens_per_s"] for r in rows) / max(r["torch_tokens_per_s"] for r in rows)

    payload = dict(
        ratio_b8=best_ratio(8), ratio_b32=best_ratio(32), multiturn_ratio=multiturn["ratio"],
        ratio_b1=best_ratio(1),
        decode_vs_bound={f"b{r['batch']}_{r['dtype']}": r["decode_vs_bound"] for r in table},
        native_kernels_decode_speedup={
            f"b{r['batch']}_{r['dtype']}": r["ours_decode_step_ms_pure_jax"] / r["ours_decode_step_ms"] for r in table},
        amx_projections_decode_speedup={
            f"b{r['batch']}_{r['dtype']}": r["ours_decode_step_ms_xla_dots"] / r["ours_decode_step_ms"] for r in table},
        amx_available=native_kernels.amx_available(),
        definition=("tokens/s = batch x 64 generated tokens / wall seconds of one generate call (prefill of the "
                    "~200-token prompts included, greedy, no early stop); ratios use each side's best dtype; "
                    "multiturn_ratio = re-prefill seconds / extend seconds; the timed calls reuse the decode loop's "
                    "weights packed by the sampler's first call (once per parameter update), "
                    "ours_seconds_after_update is a call that packs them again"),
        table=table, multiturn=multiturn, matmul_paths=paths,
        memory_bandwidth_gbs_copy=bandwidth, matmul_flops_per_s=peaks, cpu=common.cpu_facts(),
        load_average_at_end=list(os.getloadavg()), peak_rss_mib=common.peak_rss_mib(),
        benchmark_seconds=time.perf_counter() - wall,
        versions=dict(jax=jax.__version__, torch=torch.__version__),
    )
    print(common.write_json("sampler", payload))


if __name__ == "__main__":
    app.run(main)
