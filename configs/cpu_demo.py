"""The CPU demo: SmolLM2-135M-Instruct trained with GRPO on BabyAI GoTo levels, on 2 CPU cores.

    python -m launch.train --config=configs/cpu_demo.py        # what `make demo` runs

Why this slice: GoTo levels are solved by one or a few listed macro actions ("go to red ball 1"), so the
135M model's starting success is above zero (the learning signal GRPO needs) yet far from perfect. Choices made
so that the starting policy can earn reward at all, and so that the run fits in about 30 minutes here:

* ``action_matching="closest"``: a near miss such as "go to the red ball" maps to the closest listed action;
  the small model rarely copies the exact string at first.
* ``instruction_style="compact"``: the short instruction (format + one worked example), a quarter of the
  tokens of the full one; every prompt token costs forward and backward compute on a CPU.
* horizon 2 turns, 48 tokens per turn, 2 tasks x 4 samples per step, temperature 1.0 (the original's).
* per-layer remat and 2-row micro-batches keep the learner near 6.5 GB (without remat a step needs > 12 GB).
* learning rate 1e-5 (the original's 1e-6 is tuned for a 7B model and hundreds of steps).

Evaluation is greedy, on the 24 held-out GoTo test tasks (test seeds never appear in training), before and
after training, with 95% Wilson intervals; the report goes to benchmarks/results/demo.json.
"""

from agentgym_jax.run_config import base_config


def get_config(variant: str = ""):
    del variant
    c = base_config()
    c.env.name = "babyai"
    c.env.kwargs = dict(action_matching="closest", instruction_style="compact", num_test_seeds=10,
                        num_train_seeds=100)
    c.env.num_workers = 1
    c.env.train_subtasks = ("GoTo",)
    c.env.test_subtasks = ("GoTo",)
    c.data.update(dict(tasks_per_step=4, samples_per_task=4, validation_tasks=0, test_tasks=80,
                       dynamic_sampling=True, dynamic_max_rounds=2, dynamic_oversample=1.5))
    c.rollout.update(dict(max_turn_tokens=16, max_trajectory_tokens=640, temperature=0.7, canned_reply="",
                          response_prefix="Action:\n", stop_at_newline=True))
    c.horizon.type, c.horizon.turns = "fixed", 2
    c.algo.update(dict(learning_rate=5e-5, minibatch_size=8, microbatch_size=8, logprob_chunk_size=128,
                       trainable_layers=8, kl_coef=0.0, use_reference=False, temperature=0.7))
    c.train.update(dict(steps=11, workdir="runs/cpu_demo", eval_every=0, checkpoint_every=11, eval_before=True,
                        report_path="benchmarks/results/demo.json"))
    c.eval.update(dict(k=1, greedy=True, batch_tasks=80))
    return c
