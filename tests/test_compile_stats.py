"""Program-build bookkeeping from JAX's own monitoring events: compiles per function and build seconds."""

import jax
import jax.numpy as jnp

from agentgym_jax import compile_stats


def test_a_new_shape_counts_one_compile_and_its_build_time():
    compile_stats.install()

    def _stats_probe(x):
        return jnp.tanh(x) @ x.T

    probe = jax.jit(_stats_probe)
    compiles, built, backend = (compile_stats.compilations("_stats_probe"), compile_stats.total_build_seconds(),
                                compile_stats.total_compile_seconds())
    probe(jnp.ones((4, 3))).block_until_ready()
    after_first = compile_stats.total_build_seconds()
    probe(jnp.ones((4, 3))).block_until_ready()  # cached: nothing is built
    assert compile_stats.compilations("_stats_probe") == compiles + 1
    assert compile_stats.total_build_seconds() == after_first
    # a build is the trace, the lowering and the backend compile: more than the compile alone
    compiled = compile_stats.total_compile_seconds() - backend
    assert after_first - built > compiled > 0
    probe(jnp.ones((5, 3))).block_until_ready()  # a new shape builds a new program
    assert compile_stats.compilations("_stats_probe") == compiles + 2
    assert compile_stats.total_build_seconds() > after_first
