"""Token-pick cost per decode step: top-k/top-p filtering by the sampler's bisection against the sort it replaced,
and the unfiltered pick (greedy, or a draw at temperature 0.7, with the picked token's log-prob) by the native
kernel against the pure-JAX draw_tokens.

    python -m benchmarks.token_draws [--repeats=7]

Logits of SmolLM2's vocabulary (49,152) at batch 8 and 32, top_k 50 and top_p 0.9 on every row; medians of
``--repeats`` jitted calls after a compiling one. Writes benchmarks/results/token_draws.json.
"""

from __future__ import annotations

from absl import app, flags

from benchmarks.common import cpu_facts, median, time_repeats, write_json

_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed calls per variant.")
VOCABULARY = 49152


def _sorted_filter(scaled, top_k, top_p):
    """The filter the sampler used before: sort each row, rank-based top-k, cumulative top-p, in sorted order."""
    import jax
    import jax.numpy as jnp

    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    keep = jnp.where(top_k[:, None] > 0, jnp.arange(scaled.shape[-1])[None, :] < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    keep = keep & ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None])
    return jnp.where(keep, ranked, -jnp.inf), order


def main(argv: list[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp

    from agentgym_jax import native_kernels
    from agentgym_jax.token_draws import draw_tokens, top_k_top_p_mask

    variants = {"sort": jax.jit(_sorted_filter),
                "bisection": jax.jit(lambda s, k, p: jnp.where(top_k_top_p_mask(s, k, p), s, -jnp.inf))}
    results = {}
    for batch in (8, 32):
        logits = jax.random.normal(jax.random.PRNGKey(0), (batch, VOCABULARY)) * 3
        top_k, top_p = jnp.full((batch,), 50, jnp.int32), jnp.full((batch,), 0.9, jnp.float32)
        for name, fn in variants.items():
            run = lambda fn=fn: jax.block_until_ready(fn(logits, top_k, top_p))  # noqa: E731
            run()  # compiles
            results[f"b{batch}_{name}_ms"] = 1000 * median(time_repeats(run, _REPEATS.value))
        results[f"b{batch}_speedup"] = results[f"b{batch}_sort_ms"] / results[f"b{batch}_bisection_ms"]
        keys, counters = jax.random.split(jax.random.PRNGKey(1), batch), jnp.arange(batch)
        for temperature in (0.0, 0.7):
            if not native_kernels.token_pick_applies(logits):
                break  # no AVX-512 here: nothing to compare
            name = f"b{batch}_pick_t{temperature}"
            for side, kernel in (("pure_jax", False), ("native", True)):
                applies = native_kernels.token_pick_applies
                native_kernels.token_pick_applies = lambda x, on=kernel, applies=applies: on and applies(x)
                try:
                    fn = jax.jit(lambda x: draw_tokens(x, keys, counters, jnp.full((batch,), temperature), top_p,
                                                       top_k, False))
                    run = lambda fn=fn: jax.block_until_ready(fn(logits))  # noqa: E731
                    run()  # compiles
                finally:
                    native_kernels.token_pick_applies = applies
                results[f"{name}_{side}_ms"] = 1000 * median(time_repeats(run, _REPEATS.value))
            results[f"{name}_speedup"] = results[f"{name}_pure_jax_ms"] / results[f"{name}_native_ms"]
    results.update(workload=f"{VOCABULARY}-token logits, top_k 50 and top_p 0.9 on every row (filtering); greedy "
                            "and temperature-0.7 picks without filtering (pick)",
                   statistic=f"median of {_REPEATS.value} jitted calls after a compiling one", machine=cpu_facts())
    print(write_json("token_draws", results))


if __name__ == "__main__":
    app.run(main)
