"""One RL optimizer step on SmolLM2-135M-Instruct, batch 8 x 512 tokens: agentgym-jax's Learner vs torch + transformers.

Both sides do the same work per step: a teacher-forced forward over the batch, token log-probs of every agent
token, the PPO-clip loss on GRPO advantages with an entropy bonus (seq-mean-token-mean), backward, global-norm
clipping at 1.0 and one AdamW update, with fp32 master parameters. ``bfloat16`` means bf16 compute with fp32
parameters on both sides (ours: ``compute_dtype='bfloat16'``; torch: ``torch.autocast('cpu', torch.bfloat16)``).
Ours runs ``Learner.update`` (old log-probs from the batch, no reference policy: one train step per call).
Both accumulate gradients over microbatches of the batch's rows (the same gradient whatever their size); each side
runs at every size in ``--microbatches`` and is reported at its fastest, as a user would configure it.

Each side runs in its own subprocess, so its peak RSS is its own. The achieved FLOP/s (model FLOPs: 6 x matmul
parameters x tokens + causal-agnostic attention 12 x layers x B x T^2 x heads x head_dim) is divided by the FLOP/s
of a large jitted JAX matmul of the same dtype, measured in the same run.

    .venv/bin/python -m benchmarks.train_step            # writes benchmarks/results/train_step.json
    .venv/bin/python -m benchmarks.train_step --steps 2  # fewer timed steps
    .venv/bin/python -m benchmarks.train_step --lora 16 --microbatches 4  # ours: LoRA (rank 16) vs full
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import cpu_facts, matmul_flops_per_s, median, peak_rss_mib, write_json

BATCH, SEQ_LEN = 8, 512
PROMPT_TOKENS, TURNS, AGENT_TOKENS, OBS_TOKENS = 128, 4, 32, 64
DTYPES = ("float32", "bfloat16")
SEED = 0


def agent_mask() -> np.ndarray:
    """A multi-turn episode's loss mask: a 128-token prompt, then 4 turns of 32 agent tokens (1) and a 64-token
    observation (0): 25% agent tokens, as in the BabyAI/TextCraft rollouts."""
    row = np.zeros((SEQ_LEN,), np.float32)
    for turn in range(TURNS):
        start = PROMPT_TOKENS + turn * (AGENT_TOKENS + OBS_TOKENS)
        row[start:start + AGENT_TOKENS] = 1.0
    return np.repeat(row[None], BATCH, 0)


def _batch_arrays(vocab: int) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(SEED)
    tokens = rs.randint(0, vocab, (BATCH, SEQ_LEN)).astype(np.int32)
    mask = agent_mask()
    old_logp = np.where(mask > 0, -np.log(vocab) + 0.1 * rs.randn(BATCH, SEQ_LEN), 0.0).astype(np.float32)
    scores = rs.rand(BATCH).astype(np.float32)
    groups = np.repeat(np.arange(BATCH // 4), 4).astype(np.int32)
    return dict(tokens=tokens, loss_mask=mask, old_logp=old_logp, scores=scores, group_ids=groups)


def model_flops_per_step(config: dict[str, Any]) -> float:
    """Training FLOPs of one step (forward + backward, no remat recompute counted)."""
    d, f, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or d // heads
    q, k = heads * head_dim, kv * head_dim
    matmul_params = layers * (d * (q + 2 * k) + q * d + 3 * d * f) + d * config["vocab_size"]
    tokens = BATCH * SEQ_LEN
    attention = 12 * layers * BATCH * SEQ_LEN**2 * q
    return 6.0 * matmul_params * tokens + attention


# ------------------------------------------------------------------------------------------------- sides


def run_ours(model_dir: str, dtype: str, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    import jax

    from agentgym_jax import hf
    from agentgym_jax.batch import TrajectoryBatch
    from agentgym_jax.learner import Learner, LearnerConfig

    model = hf.load_model(model_dir, param_dtype="float32", dtype="float32", lora_rank=options.get("lora_rank", 0),
                          lora_alpha=options.get("lora_alpha", 16.0),
                          lora_targets=tuple(options.get("lora_targets", ())))
    config = LearnerConfig(
        learning_rate=1e-6, old_logp_source="sampler", use_reference=False, kl_coef=0.0,
        compute_dtype=dtype, remat=options["remat"], logprob_chunk_size=options["chunk"],
        minibatch_size=BATCH, microbatch_size=options["microbatch"],
    )
    learner = Learner(model, config)
    del model
    batch = TrajectoryBatch.create(**_batch_arrays(learner.policy_model().config.vocab_size))
    seconds, losses = [], []
    for i in range(steps + 1):  # the first call compiles
        start = time.perf_counter()
        metrics = learner.update(batch, jax.random.PRNGKey(i))
        jax.block_until_ready(learner.policy_state)
        seconds.append(time.perf_counter() - start)
        losses.append(metrics["total_loss"])
    return dict(first_call_s=seconds[0], step_seconds=seconds[1:], losses=losses, options=options)


def run_torch(model_dir: str, dtype: str, steps: int, microbatch: int) -> dict[str, Any]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    arrays = _batch_arrays(model.config.vocab_size)
    tokens = torch.from_numpy(arrays["tokens"]).long()
    mask = torch.from_numpy(arrays["loss_mask"])
    old_logp = torch.from_numpy(arrays["old_logp"])
    scores = torch.from_numpy(arrays["scores"]).view(-1, 4)
    advantages = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def accumulate(rows: slice) -> float:
        """Backward of the rows' share of the batch loss (seq-mean-token-mean over all BATCH rows)."""
        with autocast:
            logits = model(input_ids=tokens[rows]).logits
        logits = logits[:, :-1].float()
        log_probs = torch.log_softmax(logits, -1)
        logp = log_probs.gather(-1, tokens[rows, 1:, None])[..., 0]
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        m = mask[rows, 1:]
        ratio = torch.exp(logp - old_logp[rows, 1:])
        pg = torch.maximum(-advantages[rows] * ratio, -advantages[rows] * ratio.clamp(0.8, 1.2))
        per_token = pg - 0.001 * entropy
        loss = ((per_token * m).sum(1) / m.sum(1)).sum() / BATCH
        loss.backward()
        return float(loss)

    def step() -> float:
        loss = sum(accumulate(slice(start, start + microbatch)) for start in range(0, BATCH, microbatch))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    seconds, losses = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        losses.append(step())
        seconds.append(time.perf_counter() - start)
    return dict(first_call_s=seconds[0], step_seconds=seconds[1:], losses=losses, threads=torch.get_num_threads(),
                microbatch=microbatch)


def run_matmul(size: int, repeats: int = 5) -> dict[str, Any]:
    return dict(size=size, flops_per_s={dtype: matmul_flops_per_s(dtype, size, repeats) for dtype in DTYPES})


# ------------------------------------------------------------------------------------------------- driver


def _child(args: argparse.Namespace) -> None:
    options = json.loads(args.options)
    if args.side == "ours":
        result = run_ours(args.model_dir, args.dtype, args.steps, options)
    elif args.side == "torch":
        result = run_torch(args.model_dir, args.dtype, args.steps, options["microbatch"])
    else:
        result = run_matmul(options["size"])
    result["peak_rss_gb"] = peak_rss_mib() / 1024.0
    print("RESULT " + json.dumps(result), flush=True)


def _spawn(side: str, model_dir: str, dtype: str, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.train_step", "--child", "--side", side, "--model-dir", model_dir,
               "--dtype", dtype, "--steps", str(steps), "--options", json.dumps(options)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, all cores
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{side} {dtype} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = time.perf_counter() - started
    print(f"{side:6s} {dtype:9s} {result}", file=sys.stderr, flush=True)
    return result


def _compare_lora(model_dir: str, args: argparse.Namespace, options: dict[str, Any], tokens: int) -> None:
    """Our fp32 step with adapters of rank ``args.lora`` on every projection vs full fine-tuning: time and memory."""
    from agentgym_jax.lora import PROJECTIONS

    full = _spawn("ours", model_dir, "float32", args.steps, options)
    lora_options = dict(options, lora_rank=args.lora, lora_alpha=2.0 * args.lora, lora_targets=list(PROJECTIONS))
    adapted = _spawn("ours", model_dir, "float32", args.steps, lora_options)
    rows = {}
    for name, result in (("full", full), ("lora", adapted)):
        step_s = median(result["step_seconds"])
        rows[name] = dict(tokens_per_s=tokens / step_s, step_s=step_s, peak_rss_gb=result["peak_rss_gb"],
                          first_call_s=result["first_call_s"], loss=result["losses"][0])
    payload = dict(
        lora_rank=args.lora, lora_targets=list(PROJECTIONS), dtype="float32", full=rows["full"], lora=rows["lora"],
        peak_rss_ratio_lora_vs_full=rows["lora"]["peak_rss_gb"] / rows["full"]["peak_rss_gb"],
        speed_ratio_lora_vs_full=rows["lora"]["tokens_per_s"] / rows["full"]["tokens_per_s"],
        batch=dict(rows=BATCH, seq_len=SEQ_LEN), ours_options=options, timed_steps=args.steps,
        statistic="median of timed steps after one warm-up (compiling) step; each run in its own subprocess",
        machine=cpu_facts(),
    )
    if not args.no_write:
        print(write_json("train_step_lora", payload))
    print(json.dumps({k: v for k, v in payload.items() if k in ("full", "lora", "peak_rss_ratio_lora_vs_full",
                                                                 "speed_ratio_lora_vs_full")}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--remat", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=128, help="logprob_chunk_size (0: full logits)")
    parser.add_argument("--microbatches", default="2,4,8", help="rows per microbatch to try; each side is "
                        "reported at its fastest (the same gradient either way: accumulation is exact)")
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--lora", type=int, default=0, help="rank > 0: compare our LoRA step with our full "
                        "fine-tuning step instead (fp32; writes train_step_lora.json)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    from agentgym_jax.default_model import prepare_default_model

    model_dir = str(prepare_default_model())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    flops = model_flops_per_step(config)
    tokens = BATCH * SEQ_LEN
    microbatches = [int(m) for m in args.microbatches.split(",")]
    options = dict(remat=bool(args.remat), chunk=args.chunk or None, microbatch=microbatches[0])
    if args.lora:
        _compare_lora(model_dir, args, options, tokens)
        return
    dtypes = args.dtypes.split(",")
    matmul = _spawn("matmul", model_dir, "float32", 0, dict(size=args.matmul_size))
    per_dtype: dict[str, Any] = {}
    for dtype in dtypes:
        runs: dict[str, dict[int, Any]] = {"ours": {}, "torch": {}}
        for microbatch in microbatches:
            ours_options = dict(options, microbatch=microbatch)
            runs["ours"][microbatch] = _spawn("ours", model_dir, dtype, args.steps, ours_options)
            runs["torch"][microbatch] = _spawn("torch", model_dir, dtype, args.steps, dict(microbatch=microbatch))
        fastest = {side: min(by_mb, key=lambda mb: median(by_mb[mb]["step_seconds"])) for side, by_mb in runs.items()}
        ours, torch_side = runs["ours"][fastest["ours"]], runs["torch"][fastest["torch"]]
        ours_s, torch_s = median(ours["step_seconds"]), median(torch_side["step_seconds"])
        per_dtype[dtype] = dict(
            ours=dict(tokens_per_s=tokens / ours_s, step_s=ours_s, peak_rss_gb=ours["peak_rss_gb"],
                      first_call_s=ours["first_call_s"], step_seconds=ours["step_seconds"], loss=ours["losses"][0],
                      microbatch=fastest["ours"]),
            torch=dict(tokens_per_s=tokens / torch_s, step_s=torch_s, peak_rss_gb=torch_side["peak_rss_gb"],
                       first_call_s=torch_side["first_call_s"], step_seconds=torch_side["step_seconds"],
                       loss=torch_side["losses"][0], threads=torch_side["threads"], microbatch=fastest["torch"]),
            ratio_vs_torch=torch_s / ours_s,
            achieved_flops_per_s_ours=flops / ours_s,
            achieved_flops_per_s_torch=flops / torch_s,
            mfu_vs_matmul_ours=flops / ours_s / matmul["flops_per_s"][dtype],
            mfu_vs_matmul_torch=flops / torch_s / matmul["flops_per_s"][dtype],
            by_microbatch={side: {str(mb): dict(step_s=median(r["step_seconds"]), peak_rss_gb=r["peak_rss_gb"],
                                                loss=r["losses"][0]) for mb, r in by_mb.items()}
                           for side, by_mb in runs.items()},
        )
    headline = "float32" if "float32" in per_dtype else dtypes[0]
    best_ours = max(per_dtype, key=lambda d: per_dtype[d]["ours"]["tokens_per_s"])
    best_torch = max(per_dtype, key=lambda d: per_dtype[d]["torch"]["tokens_per_s"])
    payload = dict(
        ratio_vs_torch=per_dtype[headline]["ratio_vs_torch"],
        mfu_vs_matmul=per_dtype[headline]["mfu_vs_matmul_ours"],
        peak_rss_gb_ours=per_dtype[headline]["ours"]["peak_rss_gb"],
        peak_rss_gb_torch=per_dtype[headline]["torch"]["peak_rss_gb"],
        headline_dtype=headline,
        ratio_best_ours_vs_best_torch=(
            per_dtype[best_ours]["ours"]["tokens_per_s"] / per_dtype[best_torch]["torch"]["tokens_per_s"]
        ),
        best_dtype_ours=best_ours,
        best_dtype_torch=best_torch,
        per_dtype=per_dtype,
        matmul=matmul,
        model="SmolLM2-135M-Instruct (dequantized Q4_1 GGUF, fp32)",
        batch=dict(rows=BATCH, seq_len=SEQ_LEN, agent_tokens_per_row=int(agent_mask()[0].sum()),
                   layout=f"{PROMPT_TOKENS}-token prompt, {TURNS} x ({AGENT_TOKENS} agent + {OBS_TOKENS} observation)"),
        model_flops_per_step=flops,
        ours_options={k: v for k, v in options.items() if k != "microbatch"},
        timed_steps=args.steps,
        statistic="median of timed steps after one warm-up (compiling) step; each side in its own subprocess, at "
                  "each microbatch size, and reported at its fastest",
        machine=cpu_facts(),
    )
    if not args.no_write:
        print(write_json("train_step", payload))
    print(json.dumps({k: v for k, v in payload.items() if not isinstance(v, dict)}, indent=2))


if __name__ == "__main__":
    main()
