"""The allocator settings: applied by default, overridable, and they hand freed large buffers back (measured RSS)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import ctypes, json, sys
    from agentgym_jax.allocator import limit_allocator_retention

    applied = limit_allocator_retention() if sys.argv[1] == "apply" else {}
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)

    def rss_mb():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

    size = 16 << 20
    base = rss_mb()
    for _ in range(2):  # glibc's default raises its mmap threshold on the first free, so the second block is kept
        block = libc.malloc(size)
        libc.memset(block, 1, size)
        libc.free(block)
    print(json.dumps({"applied": applied, "held_after_free_mb": rss_mb() - base}))
""")


def _probe(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    environment.pop("AGENTGYM_JAX_MALLOC", None)
    environment.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=environment,
                         check=True)
    return json.loads(out.stdout)


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")


def test_settings_apply_by_default():
    assert _probe("apply")["applied"] == {"mmap_threshold": 4 << 20, "trim_threshold": 0, "arena_max": 2}


@pytest.mark.parametrize("env", [{"AGENTGYM_JAX_MALLOC": "default"}, {"MALLOC_ARENA_MAX": "4"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}])
def test_user_choice_wins(env):
    assert _probe("apply", **env)["applied"] == {}


def test_freed_large_buffers_leave_resident_memory():
    defaults, tuned = _probe("keep"), _probe("apply")
    # With glibc's defaults the freed 16 MB block stays resident; with the settings it is unmapped on free.
    assert defaults["held_after_free_mb"] > 12
    assert tuned["held_after_free_mb"] < 2
