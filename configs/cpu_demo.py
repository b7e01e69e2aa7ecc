"""The CPU demo: SmolLM2-135M-Instruct trained with GRPO on BabyAI GoTo levels, on 2 CPU cores.

    python -m launch.train --config=configs/cpu_demo.py        # what `make demo` runs

What the demo shows, and what it does not: on the eight single-room GoTo levels the environment offers macro
actions ("go to grey box 1"), so a task is solved by writing one listed action that names the goal's object.
The untrained 135M model mostly answers "pickup <some object>", "turn ..." or prose; RL has to teach it the right
verb and to take the object from its goal. That is format and copying learned from reward alone, not planning:
one-turn episodes can reward nothing else. Copying the goal solves about half of these tasks in one action (the
goal is in view); "turn when the goal is not in view, then go to it" (about 72% in two turns) needs multi-turn
training, which 30 minutes on 2 cores do not hold (../shared/reference/cpu-demo-probe.md has the
environment-only baselines).

Settings and why:

* ``response_prefix="Action:\n"``: every agent turn opens with this text, rendered as template glue (loss mask
  0, never trained), in training and evaluation alike, so the small model answers with an action line rather
  than prose; ``stop_at_newline`` ends the turn after that line (a turn costs ~10 decode steps, not 48).
* ``action_matching="closest"``: "go to the grey box" selects the listed "go to grey box 1"; a text naming an
  object that is not listed is still invalid.
* ``instruction_style="brief"``: the short instruction without its worked example (whose answer "go to red
  ball 1" solves the red-ball levels verbatim and is what the model copies otherwise).
* one-turn episodes in training and evaluation: the first action decides; a one-turn group shares its whole
  prompt, so sampling costs one prefill per task and the learner computes it once (``pack_rows``; minibatches
  take whole groups, ``group_minibatches``, so a minibatch of 8 holds two prompts, not up to eight).
* groups of 4 at temperature 0.7, 6 tasks per step, dynamic sampling (up to 2 rounds: groups whose 4 episodes
  all got the same reward are dropped and replaced by groups of 12 further tasks); the update sees only groups
  that carry signal, two PPO epochs over them, DAPO's clip-higher (0.28) and token-mean loss.
* only the top 8 of 30 layers train (``trainable_layers``): the backward pass stops there, which halves a
  step's compute on a CPU; the token embeddings (and so the tied output head) stay fixed too
  (``freeze_embeddings``), so the 22 frozen layers run once per step instead of in every update's forward pass
  (0.254 -> 0.463 with it, 0.425 without, each one run); learning rate 1e-4, no KL term.

Evaluation is greedy on 240 held-out GoTo test tasks (30 test seeds x 8 levels, never used in training), before
and after training, with 95% Wilson intervals and paired outcomes; the report goes to
benchmarks/results/demo.json. A 240-task evaluation takes about 5 minutes here, so the two fill a third of
the budget; 240 tasks are what makes a gain of this size distinguishable from noise.
"""

from agentgym_jax.run_config import base_config


def get_config(variant: str = ""):
    del variant
    c = base_config()
    c.env.name = "babyai"
    c.env.kwargs = dict(action_matching="closest", instruction_style="brief", num_test_seeds=30,
                        num_train_seeds=100, levels=())  # levels: () keeps all; the GoTo subtask selects the family
    c.env.num_workers = 1
    c.env.train_subtasks = ("GoTo",)
    c.env.test_subtasks = ("GoTo",)
    c.data.update(dict(tasks_per_step=6, samples_per_task=4, validation_tasks=0, test_tasks=240,
                       dynamic_sampling=True, dynamic_max_rounds=2, dynamic_oversample=2.0))
    c.rollout.update(dict(max_turn_tokens=16, max_trajectory_tokens=640, temperature=0.7, canned_reply="",
                          response_prefix="Action:\n", stop_at_newline=True))
    c.horizon.type, c.horizon.turns = "fixed", 1
    c.algo.update(dict(
        old_logp_source="sampler", pack_rows=True, group_minibatches=True, loss_aggregation="token-mean", learning_rate=1e-4, clip_high=0.28, ppo_epochs=2, minibatch_size=8,
        microbatch_size=4, logprob_chunk_size=128, trainable_layers=8, freeze_embeddings=True, kl_coef=0.0,
        use_reference=False,
        temperature=0.7))
    c.train.update(dict(steps=12, workdir="runs/cpu_demo", eval_every=0, checkpoint_every=12, eval_before=True,
                        report_path="benchmarks/results/demo.json"))
    c.eval.update(dict(k=1, greedy=True, batch_tasks=60, horizon=1))
    return c
