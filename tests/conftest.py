"""Test session set-up: 8 simulated CPU devices (for mesh tests) and shared tiny-model fixtures."""

import os

# Must happen before JAX is imported anywhere: every test sees 8 CPU devices; unsharded code uses device 0.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Task datasets the tests build (synthetic envs, custom env arguments) go to a throwaway directory.
if "AGENTGYM_JAX_TASK_DATA" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["AGENTGYM_JAX_TASK_DATA"] = tempfile.mkdtemp(prefix="agentgym-task-data-")
    atexit.register(shutil.rmtree, os.environ["AGENTGYM_JAX_TASK_DATA"], ignore_errors=True)
