"""WebArena with GRPO, reproducing the original's scripts (Qwen2.5-7B-Instruct on 8 accelerators).

    export WA_SHOPPING=http://host:7770 WA_SHOPPING_ADMIN=http://host:7780/admin WA_REDDIT=http://host:9999 \
           WA_GITLAB=http://host:8023 WA_MAP=http://host:3000 WA_WIKIPEDIA=http://host:8888 \
           WEBARENA_AUTH_DIR=/path/to/.auth WEBARENA_JUDGE_URL=http://judge:8000/v1/chat/completions
    python -m launch.train --config=configs/webarena_grpo.py --config.model.path=/models/Qwen2.5-7B-Instruct
    python -m launch.train --config=configs/webarena_grpo.py:scaling --config.model.path=...   # ScalingInter-RL

``fixed`` (default): examples/train/AgentGym-RL/webarena_train.sh: 15 turns, n=4, 32 tasks/step, 16-trajectory
minibatches (4 prompts x 4 samples), ppo_epochs 2 (honoured here), prompt 750 + response 14098 tokens, 512 per turn.
``scaling``: examples/train/ScalingInter-RL/webarena_train.sh: horizons [8, 12, 15] every 80 steps, otherwise the
same.
``gpu``: the ``fixed`` recipe on one accelerator (``run_config.single_accelerator``) for a 0.5B-3B Qwen2.5-class
local checkpoint; its step time is dominated by the browsers and the sites, not estimated here.

Sites are real WebArena deployments addressed by URL: the ``WA_<SITE>`` variables above (or
``--config.env.kwargs.sites``), login state from WebArena's ``auto_login.py`` in ``WEBARENA_AUTH_DIR``, and the
fuzzy_match judge at ``WEBARENA_JUDGE_URL`` (tasks graded by fuzzy_match refuse to start without one). Every
episode holds a Chromium (a few hundred MB, see docs/web.md), so 128 concurrent episodes need tens of GB of host
memory; restrict the task families with ``--config.env.train_subtasks=shopping,shopping_admin`` when only some
sites are deployed.
"""

from agentgym_jax.run_config import accelerator_config, single_accelerator


def get_config(variant: str = "fixed"):
    if variant == "gpu":
        return single_accelerator(get_config("fixed"))
    c = accelerator_config("webarena", variant)
    c.env.step_timeout_s = 300.0  # page loads plus a program_html grading pass on a loaded deployment
    c.data.tasks_per_step, c.data.samples_per_task = 32, 4
    c.algo.minibatch_size, c.algo.ppo_epochs = 16, 2
    c.rollout.max_turn_tokens, c.rollout.max_trajectory_tokens = 512, 750 + 14098
    if variant == "fixed":
        c.horizon.type, c.horizon.turns = "fixed", 15
    elif variant == "scaling":
        c.horizon.type, c.horizon.rounds, c.horizon.steps_per_stage = "stepwise", (8, 12, 15), 80
    else:
        raise ValueError(f"unknown variant {variant!r}; use 'fixed', 'scaling' or 'gpu'")
    return c
