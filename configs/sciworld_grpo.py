"""SciWorld with GRPO, reproducing the original's scripts (Qwen2.5-7B-Instruct on 8 accelerators).

    python -m launch.train --config=configs/sciworld_grpo.py --config.model.path=/models/Qwen2.5-7B-Instruct
    python -m launch.train --config=configs/sciworld_grpo.py:scaling --config.model.path=...

``fixed``: 20 turns, n=8, 16 tasks/step, 64-trajectory minibatches, prompt 1024 + response 4096, 200 per turn.
``scaling``: horizons [10, 20, 30] every 100 steps, response 8192.
Each SciWorld worker runs its own JVM (heap capped), so env.num_workers bounds host memory.
``gpu``: the ``fixed`` recipe on one accelerator (``run_config.single_accelerator``) for a 0.5B-3B Qwen2.5-class
local checkpoint, e.g. ``--config.model.path=/models/Qwen2.5-1.5B-Instruct``; about 200 s per step on one
H100/H200 with 1.5B parameters (an estimate, not a measurement; see ``run_config.GPU_STEP_SECONDS_ESTIMATE``).
"""

from agentgym_jax.run_config import accelerator_config, single_accelerator


def get_config(variant: str = "fixed"):
    if variant == "gpu":
        return single_accelerator(get_config("fixed"))
    c = accelerator_config("sciworld", variant)
    c.data.tasks_per_step, c.data.samples_per_task = 16, 8
    c.algo.minibatch_size = 64
    c.rollout.max_turn_tokens = 200
    if variant == "fixed":
        c.horizon.type, c.horizon.turns = "fixed", 20
        c.rollout.max_trajectory_tokens = 1024 + 4096
    elif variant == "scaling":
        c.horizon.type, c.horizon.rounds, c.horizon.steps_per_stage = "stepwise", (10, 20, 30), 100
        c.rollout.max_trajectory_tokens = 1024 + 8192
    else:
        raise ValueError(f"unknown variant {variant!r}; use 'fixed', 'scaling' or 'gpu'")
    return c
