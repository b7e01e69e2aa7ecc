"""BabyAI with GRPO, reproducing the original's scripts (Qwen2.5-7B-Instruct on 8 accelerators).

    python -m launch.train --config=configs/babyai_grpo.py --config.model.path=/models/Qwen2.5-7B-Instruct
    python -m launch.train --config=configs/babyai_grpo.py:scaling --config.model.path=...   # ScalingInter-RL

``fixed`` (default): examples/train/AgentGym-RL/babyai_train.sh: 20 turns, n=8, 16 tasks/step, 64-trajectory
minibatches, prompt 1024 + response 4096 tokens, 200 tokens per turn.
``scaling``: examples/train/ScalingInter-RL/babyai_train.sh: horizons [6, 13, 20] every 100 steps, n=4,
32 tasks/step, 32-trajectory minibatches, 512 tokens per turn, response 8192, ppo_epochs 2 (honoured here).
``gpu``: the ``fixed`` recipe on one accelerator (``run_config.single_accelerator``) for a 0.5B-3B Qwen2.5-class
local checkpoint, e.g. ``--config.model.path=/models/Qwen2.5-1.5B-Instruct``; about 150 s per step on one
H100/H200 with 1.5B parameters (an estimate, not a measurement; see ``run_config.GPU_STEP_SECONDS_ESTIMATE``).
"""

from agentgym_jax.run_config import accelerator_config, single_accelerator


def get_config(variant: str = "fixed"):
    if variant == "gpu":
        return single_accelerator(get_config("fixed"))
    c = accelerator_config("babyai", variant)
    c.env.kwargs = dict(action_matching="exact")
    if variant == "fixed":
        c.horizon = dict(type="fixed", turns=20, rounds=(20,), steps_per_stage=100, stage_starts=(), start=1,
                         end=1, increment=1)
        c.data.tasks_per_step, c.data.samples_per_task = 16, 8
        c.algo.minibatch_size = 64
        c.rollout.max_turn_tokens, c.rollout.max_trajectory_tokens = 200, 1024 + 4096
    elif variant == "scaling":
        c.horizon = dict(type="stepwise", turns=20, rounds=(6, 13, 20), steps_per_stage=100, stage_starts=(),
                         start=1, end=1, increment=1)
        c.data.tasks_per_step, c.data.samples_per_task = 32, 4
        c.algo.minibatch_size, c.algo.ppo_epochs = 32, 2
        c.rollout.max_turn_tokens, c.rollout.max_trajectory_tokens = 512, 512 + 8192
    else:
        raise ValueError(f"unknown variant {variant!r}; use 'fixed', 'scaling' or 'gpu'")
    return c
