"""Sampling a LoRA policy: adapters applied unmerged (what the trainer does) vs merged into the weights.

A merged policy is a plain model of the same shapes, so its speed is the base model's; unmerged adds two thin
matmuls per adapted projection. Decode of SmolLM2-135M at batch 8 (128-token prompts, 32 new tokens, greedy),
adapters of rank 16 on every projection, medians of ``--repeats`` timed calls after a compiling one.

    .venv/bin/python -m benchmarks.lora_sampling      # writes benchmarks/results/lora_sampling.json
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from benchmarks.common import cpu_facts, median, peak_rss_mib, write_json

BATCH, PROMPT, NEW_TOKENS, RANK = 8, 128, 32, 16


def _seconds(model, repeats: int) -> list[float]:
    from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams

    sampler = Sampler(model, SamplerConfig(cache_length=256))
    prompts = [list(np.random.RandomState(i).randint(3, 2000, PROMPT)) for i in range(BATCH)]
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    times = []
    for i in range(repeats + 1):  # the first call compiles
        start = time.perf_counter()
        _, out = sampler.generate(sampler.new_state(BATCH), prompts, jax.random.PRNGKey(i), params)
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from flax import nnx

    from agentgym_jax import hf
    from agentgym_jax.default_model import prepare_default_model
    from agentgym_jax.lora import PROJECTIONS

    model_dir = prepare_default_model()
    merged_equivalent = hf.load_model(model_dir)  # a merged LoRA policy has exactly these shapes and programs
    adapted = hf.load_model(model_dir, lora_rank=RANK, lora_alpha=2.0 * RANK, lora_targets=PROJECTIONS)
    graphdef, state = nnx.split(adapted)
    flat = [(k, v.replace(v[...] + 0.01) if k[-1] == "lora_b" else v) for k, v in nnx.to_flat_state(state)]
    adapted = nnx.merge(graphdef, nnx.from_flat_state(flat))  # non-zero adapters, as after training
    merged_s = median(_seconds(merged_equivalent, args.repeats))
    unmerged_s = median(_seconds(adapted, args.repeats))
    payload = dict(
        merged_s=merged_s, unmerged_s=unmerged_s, unmerged_vs_merged_time=unmerged_s / merged_s,
        batch=BATCH, prompt_tokens=PROMPT, new_tokens=NEW_TOKENS, lora_rank=RANK, lora_targets=list(PROJECTIONS),
        peak_rss_gb=peak_rss_mib() / 1024.0, repeats=args.repeats,
        statistic="median seconds of one generate call (prefill + decode) after a compiling call",
        machine=cpu_facts(),
    )
    print(write_json("lora_sampling", payload))
    print({k: payload[k] for k in ("merged_s", "unmerged_s", "unmerged_vs_merged_time")})


if __name__ == "__main__":
    main()
