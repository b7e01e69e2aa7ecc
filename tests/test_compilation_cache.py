"""The launchers' persistent compilation cache: a second process loads the program the first one compiled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentgym_jax import compilation_cache
from agentgym_jax.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
from agentgym_jax import compilation_cache
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
compilation_cache.enable(sys.argv[1], min_compile_seconds=0.0)
forward = jax.jit(lambda w, x: jnp.tanh(x @ w) @ w.T)
value = float(forward(jnp.ones((64, 64)), jnp.ones((8, 64))).sum())
print(json.dumps(dict(value=value, hits=events.count("/jax/compilation_cache/cache_hits"),
                      misses=events.count("/jax/compilation_cache/cache_misses"))))
"""


def _run(cache_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(cache_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_compiled_program(tmp_path):
    cache_dir = tmp_path / "xla"
    first = _run(cache_dir)
    assert first["hits"] == 0 and first["misses"] >= 1  # the jitted function and jnp's own small programs
    assert any(cache_dir.iterdir()), "nothing was written to the cache"
    second = _run(cache_dir)
    assert second["misses"] == 0 and second["hits"] == first["misses"]  # every program read back, none compiled
    assert second["value"] == first["value"]


def test_an_unusable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="compilation_cache_dir"):
        compilation_cache.enable(blocker / "xla")
