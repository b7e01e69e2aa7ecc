"""The CPU demo: SmolLM2-135M-Instruct learns BabyAI GoTo levels with GRPO on 2 CPU cores in under 30 minutes.

    python -m launch.train --config=configs/cpu_demo.py        # what `make demo` runs

Why this slice: GoTo levels are solved by one or a few listed macro actions ("go to red ball 1"), so the
135M model's starting success is above zero (the learning signal GRPO needs) yet far from perfect. The action
parser maps a near miss ("go to the red ball") to the closest listed action (``action_matching="closest"``),
because the small model rarely copies the exact string at first; the prompt has one worked example. Learning
rate 1e-5 (the original's 1e-6 is tuned for a 7B model and hundreds of steps). Evaluation is greedy on held-out
test seeds, before and after training, with 95% Wilson intervals; results go to benchmarks/results/demo.json.
"""

from agentgym_jax.run_config import base_config


def get_config(variant: str = ""):
    del variant
    c = base_config()
    c.env.name = "babyai"
    c.env.kwargs = dict(action_matching="closest", num_test_seeds=6, num_train_seeds=100)
    c.env.num_workers = 1
    c.env.train_subtasks = ("GoTo",)
    c.env.test_subtasks = ("GoTo",)
    c.data.update(dict(tasks_per_step=4, samples_per_task=4, validation_tasks=0, test_tasks=48))
    c.rollout.update(dict(max_turn_tokens=40, max_trajectory_tokens=1024, temperature=1.0, canned_reply=""))
    c.horizon.type, c.horizon.turns = "fixed", 3
    c.algo.update(dict(learning_rate=1e-5, minibatch_size=16, microbatch_size=4, logprob_chunk_size=256))
    c.train.update(dict(steps=16, workdir="runs/cpu_demo", eval_every=0, checkpoint_every=8, eval_before=True,
                        report_path="benchmarks/results/demo.json"))
    c.eval.update(dict(k=1, greedy=True, batch_tasks=24))
    return c
