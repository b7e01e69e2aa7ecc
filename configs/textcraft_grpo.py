"""TextCraft with GRPO, reproducing the original's scripts (Qwen2.5-7B-Instruct on 8 accelerators).

    python -m launch.train --config=configs/textcraft_grpo.py --config.model.path=/models/Qwen2.5-7B-Instruct
    python -m launch.train --config=configs/textcraft_grpo.py:scaling --config.model.path=...

``fixed``: 30 turns, n=8, 32 tasks/step, 64-trajectory minibatches, prompt 512 + response 10240, 512 per turn.
``scaling``: horizons [10, 20, 30] every 100 steps, otherwise the same; ppo_epochs 2 (honoured here).
``gpu``: the ``fixed`` recipe on one accelerator (``run_config.single_accelerator``) for a 0.5B-3B Qwen2.5-class
local checkpoint, e.g. ``--config.model.path=/models/Qwen2.5-1.5B-Instruct``; about 300 s per step on one
H100/H200 with 1.5B parameters (an estimate, not a measurement; see ``run_config.GPU_STEP_SECONDS_ESTIMATE``).
"""

from agentgym_jax.run_config import accelerator_config, single_accelerator


def get_config(variant: str = "fixed"):
    if variant == "gpu":
        return single_accelerator(get_config("fixed"))
    c = accelerator_config("textcraft", variant)
    c.data.tasks_per_step, c.data.samples_per_task = 32, 8
    c.algo.minibatch_size, c.algo.ppo_epochs = 64, 2
    c.rollout.max_turn_tokens, c.rollout.max_trajectory_tokens = 512, 512 + 10240
    if variant == "fixed":
        c.horizon.type, c.horizon.turns = "fixed", 30
    elif variant == "scaling":
        c.horizon.type, c.horizon.rounds, c.horizon.steps_per_stage = "stepwise", (10, 20, 30), 100
    else:
        raise ValueError(f"unknown variant {variant!r}; use 'fixed', 'scaling' or 'gpu'")
    return c
