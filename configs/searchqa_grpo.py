"""Deep Search (searchqa) with GRPO, reproducing the original's scripts (Qwen2.5-7B-Instruct on 8 accelerators).

    python -m launch.train --config=configs/searchqa_grpo.py --config.model.path=/models/Qwen2.5-7B-Instruct
    python -m launch.train --config=configs/searchqa_grpo.py:scaling --config.model.path=...   # ScalingInter-RL
    python -m launch.train --config=configs/searchqa_grpo.py:cpu                                # this machine

``fixed`` (default): examples/train/AgentGym-RL/searchqa_train.sh: 5 turns, n=4, 32 questions/step, 32-trajectory
minibatches, ppo_epochs 2 (honoured here), prompt 1024 + response 8192 tokens, 512 tokens per turn.
``scaling``: examples/train/ScalingInter-RL/searchqa_train.sh: horizons [5, 8, 10] every 100 steps, otherwise
the same.
``gpu``: the ``fixed`` recipe on one accelerator (``run_config.single_accelerator``) for a 0.5B-3B Qwen2.5-class
local checkpoint; about 120 s per step with 1.5B parameters (an estimate, not a measurement).
``cpu``: the default SmolLM2-135M on the generated geography set, 2 turns (search, then answer), 4 questions x 4
samples per step, top 8 layers trained; a smoke-sized run for this 2-core machine, not a recipe that learns much
(measured: about 82 s per step; the untrained 135M model rarely writes the tags, so success starts at 0).

Questions and retrieval: the generated set with bm25 by default (``environments/searchqa``). The original's data:
``--config.env.kwargs.dataset=flashrag --config.env.kwargs.flashrag_dir=/data/FlashRAG_datasets`` with
``retriever_url=http://host:8000`` (a Search-R1 retrieval server over wiki-18) or the ``dense_*`` keys (the e5
FAISS index in process). Turns stop at ``</search>`` or ``</answer>`` as in Search-R1's rollout.
"""

from agentgym_jax.run_config import accelerator_config, base_config, single_accelerator

STOP_STRINGS = ("</search>", "</answer>")


def get_config(variant: str = "fixed"):
    if variant == "gpu":
        return single_accelerator(get_config("fixed"))
    if variant == "cpu":
        return _cpu()
    c = accelerator_config("searchqa", variant)
    c.env.kwargs = dict(dataset="generated")
    c.data.tasks_per_step, c.data.samples_per_task = 32, 4
    c.algo.minibatch_size, c.algo.ppo_epochs = 32, 2
    c.rollout.max_turn_tokens, c.rollout.max_trajectory_tokens = 512, 1024 + 8192
    c.rollout.stop_strings = STOP_STRINGS
    if variant == "fixed":
        c.horizon.type, c.horizon.turns = "fixed", 5
    elif variant == "scaling":
        c.horizon.type, c.horizon.rounds, c.horizon.steps_per_stage = "stepwise", (5, 8, 10), 100
    else:
        raise ValueError(f"unknown variant {variant!r}; use 'fixed', 'scaling', 'gpu' or 'cpu'")
    return c


def _cpu():
    c = base_config()
    c.env.name, c.env.kwargs, c.env.num_workers = "searchqa", dict(dataset="generated"), 1
    c.data.update(dict(tasks_per_step=4, samples_per_task=4, validation_tasks=0, test_tasks=16))
    c.rollout.update(dict(max_turn_tokens=48, max_trajectory_tokens=1024, stop_strings=STOP_STRINGS, canned_reply=""))
    c.horizon.type, c.horizon.turns = "fixed", 2
    c.algo.update(dict(
        old_logp_source="sampler", learning_rate=1e-5, minibatch_size=8, microbatch_size=4,
        logprob_chunk_size=128, trainable_layers=8, kl_coef=0.0, use_reference=False))
    c.train.update(dict(steps=10, workdir="runs/searchqa_cpu", eval_every=0, checkpoint_every=10))
    c.eval.update(dict(k=1, greedy=True, batch_tasks=16, horizon=2))
    return c
