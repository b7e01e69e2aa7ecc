"""One prepared accelerator check: sampler tokens/s and train-step MFU of a Qwen2.5-1.5B-shaped model with random
weights, ours and transformers on the same device. Run by ``benchmarks/gpu_check.sh`` (one call, under 5 minutes
on one H100/H200-class GPU; no network needed).

    python -m benchmarks.gpu_check                      # writes benchmarks/results/gpu.json
    python -m benchmarks.gpu_check --shape=tiny         # the same code path on a CPU, in seconds (tested)

Sampler: greedy, ``--batch`` prompts of 512 random tokens, 128 new tokens, bf16 weights and cache; tokens/s =
batch x new tokens / seconds of one generate call (prefill included), median of 3 after a compiling call. Train
step: ``Learner.update`` on 8 x 1024 tokens (bf16 compute, fp32 master weights, per-layer remat) against torch +
transformers with autocast bf16 and AdamW; MFU = model FLOPs (6 x matmul parameters x tokens + attention) / step
seconds / the device's peak bf16 FLOP/s (``--peak_tflops``, 989 for an H100/H200 SXM dense).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from agentgym_jax import compile_stats
from benchmarks.common import RESULTS_DIR

SHAPES = {  # Qwen2.5-1.5B's dimensions, and a tiny one for checking the script on a CPU
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
PROMPT, NEW, TRAIN_ROWS, TRAIN_LEN = 512, 128, 8, 1024


def save_random_model(shape: str, directory: Path) -> dict[str, Any]:
    """A random-weight Qwen2 checkpoint of ``shape`` in ``directory`` (bf16), as transformers writes it."""
    import torch
    import transformers

    dims = SHAPES[shape]
    config = transformers.Qwen2Config(**dims, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    return dims


def model_flops(dims: dict[str, Any], rows: int, length: int) -> float:
    d, f, layers = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    head_dim = d // dims["num_attention_heads"]
    q, k = dims["num_attention_heads"] * head_dim, dims["num_key_value_heads"] * head_dim
    matmul_params = layers * (d * (q + 2 * k) + q * d + 3 * d * f) + d * dims["vocab_size"]
    return 6.0 * matmul_params * rows * length + 12 * layers * rows * length**2 * q


def _median_seconds(fn, repeats: int = 3) -> tuple[float, float]:
    """(first call seconds, median of ``repeats`` further calls)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    print(f"  first call {first:.1f} s", flush=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def sampler_ours(model_dir: Path, prompts: list[list[int]]) -> dict[str, float]:
    import jax

    from agentgym_jax import hf
    from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams

    model = hf.load_model(model_dir, param_dtype="bfloat16", dtype="bfloat16")
    # One prefill block (prefill_chunk=0): on a GPU a 512-token prompt is one matmul-bound call, and chunks would
    # only add programs to compile.
    sampler = Sampler(model, SamplerConfig(cache_length=1024, cache_dtype="bfloat16",
                                           window_buckets=(256, 512, 768), prefill_chunk=0))

    def run() -> None:
        state = sampler.new_state(len(prompts))
        _, result = sampler.generate(state, prompts, jax.random.PRNGKey(0),
                                     SamplingParams(temperature=0.0, max_new_tokens=NEW))
        assert all(len(t) == NEW for t in result.tokens)

    compiled = compile_stats.total_compile_seconds()
    first, seconds = _median_seconds(run)
    return {"tokens_per_s": len(prompts) * NEW / seconds, "seconds": seconds, "first_call_s": first,
            "xla_compile_s": compile_stats.total_compile_seconds() - compiled}


def sampler_torch(model_dir: Path, prompts: list[list[int]], device: str) -> dict[str, float]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    ids = torch.tensor(prompts, device=device)

    def run() -> None:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0, use_cache=True)
        assert out.shape[1] - ids.shape[1] == NEW
        if device != "cpu":
            torch.cuda.synchronize()

    first, seconds = _median_seconds(run)
    return {"tokens_per_s": len(prompts) * NEW / seconds, "seconds": seconds, "first_call_s": first}


def _train_arrays(vocab: int) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(0)
    tokens = rs.randint(0, vocab, (TRAIN_ROWS, TRAIN_LEN)).astype(np.int32)
    mask = np.zeros((TRAIN_ROWS, TRAIN_LEN), np.float32)
    mask[:, TRAIN_LEN // 4:] = 1.0  # prompt unmasked, the rest agent tokens
    old_logp = np.where(mask > 0, -np.log(vocab), 0.0).astype(np.float32)
    scores = rs.rand(TRAIN_ROWS).astype(np.float32)
    return dict(tokens=tokens, loss_mask=mask, old_logp=old_logp, scores=scores,
                group_ids=np.repeat(np.arange(TRAIN_ROWS // 4), 4).astype(np.int32))


def train_ours(model_dir: Path, dims: dict[str, Any]) -> dict[str, float]:
    import jax

    from agentgym_jax import hf
    from agentgym_jax.batch import TrajectoryBatch
    from agentgym_jax.learner import Learner, LearnerConfig

    learner = Learner(hf.load_model(model_dir, param_dtype="float32", dtype="float32"),
                      LearnerConfig(learning_rate=1e-6, old_logp_source="sampler", use_reference=False, kl_coef=0.0,
                                    compute_dtype="bfloat16", remat=True, minibatch_size=TRAIN_ROWS,
                                    microbatch_size=TRAIN_ROWS))
    batch = TrajectoryBatch.create(**_train_arrays(dims["vocab_size"]))

    def run() -> None:
        learner.update(batch, jax.random.PRNGKey(0))
        jax.block_until_ready(learner.policy_state)

    compiled = compile_stats.total_compile_seconds()
    first, seconds = _median_seconds(run)
    return {"step_s": seconds, "first_call_s": first,
            "xla_compile_s": compile_stats.total_compile_seconds() - compiled}


def train_torch(model_dir: Path, dims: dict[str, Any], device: str) -> dict[str, float]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.gradient_checkpointing_enable()
    model.train()
    arrays = {k: torch.from_numpy(v).to(device) for k, v in _train_arrays(dims["vocab_size"]).items()}
    tokens, mask, old_logp = arrays["tokens"].long(), arrays["loss_mask"], arrays["old_logp"]
    scores = arrays["scores"].view(-1, 4)
    advantages = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)

    def run() -> None:
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            logits = model(input_ids=tokens).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        ratio = torch.exp(logp - old_logp[:, 1:])
        loss = (torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2)) * mask[:, 1:]).sum()
        (loss / mask[:, 1:].sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device != "cpu":
            torch.cuda.synchronize()

    first, seconds = _median_seconds(run)
    return {"step_s": seconds, "first_call_s": first}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--peak_tflops", type=float, default=989.0)
    parser.add_argument("--out", default=str(RESULTS_DIR / "gpu.json"))
    args = parser.parse_args(argv)
    import jax
    import torch

    compile_stats.install()
    wall = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    payload: dict[str, Any] = {
        "shape": args.shape, "device": str(jax.devices()[0].device_kind), "torch_device": device,
        "peak_tflops_assumed": args.peak_tflops, "complete": False,
        "definition": (f"sampler: greedy, {PROMPT}-token prompts, {NEW} new tokens, bf16; train: {TRAIN_ROWS} x "
                       f"{TRAIN_LEN} tokens, bf16 compute, fp32 master, remat; medians of 3 after a compiling call"),
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
    }

    def save() -> None:  # after every section, so that a run cut short still leaves what it measured
        payload["seconds"] = time.perf_counter() - wall
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"[{payload['seconds']:.0f} s] wrote {args.out}", flush=True)

    with tempfile.TemporaryDirectory(prefix="agentgym-gpu-check-") as scratch:
        model_dir = Path(scratch) / "model"
        payload["dims"] = dims = save_random_model(args.shape, model_dir)
        rs = np.random.RandomState(1)
        payload["sampler"] = sampler = []

        def measure_sampler(batch: int) -> None:
            prompts = rs.randint(10, dims["vocab_size"] - 10, (batch, PROMPT)).tolist()
            ours, theirs = sampler_ours(model_dir, prompts), sampler_torch(model_dir, prompts, device)
            sampler.append({"batch": batch, "ours": ours, "transformers": theirs,
                            "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"]})
            print(sampler[-1], flush=True)
            save()

        # The first batch, then the train step, then the other batches: a run cut short keeps one of each.
        measure_sampler(args.batch[0])
        flops = model_flops(dims, TRAIN_ROWS, TRAIN_LEN)
        peak = args.peak_tflops * 1e12
        ours = train_ours(model_dir, dims)
        payload["train_step"] = {"ours": {**ours, "mfu": flops / ours["step_s"] / peak},
                                 "model_flops_per_step": flops}
        print(payload["train_step"], flush=True)
        save()
        theirs = train_torch(model_dir, dims, device)
        payload["train_step"].update(transformers={**theirs, "mfu": flops / theirs["step_s"] / peak},
                                     ratio_vs_torch=theirs["step_s"] / ours["step_s"])
        print(payload["train_step"], flush=True)
        save()
        for batch in args.batch[1:]:
            measure_sampler(batch)
    payload["complete"] = True
    save()


if __name__ == "__main__":
    main()
