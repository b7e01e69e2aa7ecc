"""Learning test: a one-step bandit on the tiny model, sampled by the real Sampler and trained by the Learner.

Each trajectory is a short prompt followed by one sampled token; the reward is 1 when that token is in a fixed set
holding 1/8 of the vocabulary. Every estimator and policy loss must raise the mean reward from the random level (~0.125) to > 0.9.
"""

import dataclasses

import jax
import numpy as np
import pytest

from agentgym_jax import hf
from agentgym_jax.batch import TrajectoryBatch
from agentgym_jax.learner import Learner, LearnerConfig
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams

VOCAB = 256
REWARDED = np.arange(VOCAB) % 8 == 3  # 32 of 256 token ids
PROMPTS = [[1, 10, 20, 30], [1, 11, 21], [1, 12, 22, 32, 42], [1, 13]]
SAMPLES_PER_PROMPT = 8
SEQ_LEN = 8
ONE_TOKEN = SamplingParams(temperature=1.0, max_new_tokens=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_models import save_hf_model

    return save_hf_model("llama-gqa-tied", tmp_path_factory.mktemp("bandit"))


def _sample(sampler: Sampler, rng: jax.Array, repeats: int = 1) -> tuple[TrajectoryBatch, float]:
    """One rollout batch (prompts x samples x repeats) and its mean reward."""
    prompts = [p for p in PROMPTS for _ in range(SAMPLES_PER_PROMPT * repeats)]
    _, result = sampler.generate(sampler.new_state(len(prompts)), prompts, rng, ONE_TOKEN)
    actions = [tokens[0] for tokens in result.tokens]
    rewards = REWARDED[actions].astype(np.float32)
    batch = TrajectoryBatch.from_rows(
        token_rows=[p + [a] for p, a in zip(prompts, actions)],
        mask_rows=[[0.0] * len(p) + [1.0] for p in prompts],
        logp_rows=[[0.0] * len(p) + list(lp) for p, lp in zip(prompts, result.logprobs)],
        scores=rewards,
        group_ids=[i // (SAMPLES_PER_PROMPT * repeats) for i in range(len(prompts))],
        seq_len=SEQ_LEN,
    )
    # One turn per trajectory, acting in the state its prompt shows (for step-level estimators).
    batch = dataclasses.replace(
        batch, turn_ids=np.where(batch.loss_mask > 0, 0, -1).astype(np.int32), step_rewards=rewards[:, None],
        step_states=np.asarray([PROMPTS.index(p) for p in prompts], np.int32)[:, None])
    return batch, float(rewards.mean())


def _train(model_dir, config: LearnerConfig, iterations: int = 60, **load) -> tuple[float, float, list[float]]:
    model = hf.load_model(model_dir, **load)
    sampler = Sampler(model, SamplerConfig(cache_length=16, batch_buckets=(32, 128)))
    learner = Learner(model, config)
    rng = jax.random.PRNGKey(0)
    _, initial = _sample(sampler, jax.random.fold_in(rng, 10_000), repeats=4)
    curve = []
    for i in range(iterations):
        batch, reward = _sample(sampler, jax.random.fold_in(rng, i))
        curve.append(reward)
        if len(curve) >= 3 and min(curve[-3:]) > 0.95:
            break
        metrics = learner.update(batch, jax.random.fold_in(rng, 20_000 + i))
        assert metrics["skipped_updates"] == 0
        sampler.update_params(learner.policy_state)  # the learner's arrays, updated in place
    _, final = _sample(sampler, jax.random.fold_in(rng, 10_001), repeats=4)
    return initial, final, curve


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("grpo", dict(advantage_estimator="grpo")),
        ("rloo", dict(advantage_estimator="rloo", old_logp_source="sampler")),
        ("reinforce_pp", dict(advantage_estimator="reinforce_pp", kl_in_reward=True)),
        ("ppo", dict(advantage_estimator="gae", critic_learning_rate=1e-2, ppo_epochs=2, minibatch_size=16)),
        ("gigpo", dict(advantage_estimator="gigpo")),
        ("gspo", dict(policy_loss="gspo")),
        ("cispo", dict(policy_loss="cispo", old_logp_source="sampler")),
    ],
)
def test_bandit_reward_rises_above_0_9(model_dir, name, overrides):
    config = LearnerConfig(learning_rate=1e-2, **overrides)
    initial, final, curve = _train(model_dir, config)
    assert initial < 0.3, f"{name}: the untrained policy should be near the random level 0.125, got {initial}"
    assert final > 0.9, f"{name}: mean reward {initial:.3f} -> {final:.3f}; curve {np.round(curve, 2).tolist()}"


@pytest.fixture(scope="module")
def wide_embedding_dir(tmp_path_factory):
    """The tiny model with its (tied) embedding scaled up: with the output head frozen, as under LoRA, the
    hidden state must be able to move the logits (at the usual 0.02 scale they span only about +-0.2)."""
    import torch

    from tests.tiny_models import make_hf_model

    model = make_hf_model("llama-gqa-tied")
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10.0)
    directory = tmp_path_factory.mktemp("bandit-wide")
    model.save_pretrained(directory)
    return directory


def test_lora_policy_learns_the_bandit_with_the_base_as_reference(wide_embedding_dir):
    # Adapters on every projection (the embedding/output head stays frozen), KL to the base model.
    config = LearnerConfig(learning_rate=3e-2, advantage_estimator="grpo", kl_coef=0.001)
    initial, final, curve = _train(wide_embedding_dir, config, lora_rank=8, lora_alpha=16.0,
                                   lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"))
    assert initial < 0.3 and final > 0.9, f"LoRA: {initial:.3f} -> {final:.3f}; curve {np.round(curve, 2).tolist()}"
