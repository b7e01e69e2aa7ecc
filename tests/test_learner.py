"""The learner: exact gradient accumulation, agent-only gradients, NaN skipping, meshes, checkpoints, bad input."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import compile_stats, hf, sharding
from agentgym_jax.batch import BatchError, TrajectoryBatch
from agentgym_jax.critic import Critic
from agentgym_jax.errors import ConfigError
from agentgym_jax.learner import (
    TRAIN_STEP_NAME, Learner, LearnerConfig, learning_rate_schedule, loss_denominator, policy_loss,
    TrainingBatch, policy_loss_terms, token_logprobs, token_logprobs_from_logits,
)

B, T = 8, 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_models import save_hf_model

    return save_hf_model("qwen2-mha-tied", tmp_path_factory.mktemp("qwen2-learner"))


def _batch(seed: int = 0, rows: int = B) -> TrajectoryBatch:
    """Multi-turn rows: prompt, agent turn, env observation, agent turn, trailing env tokens; ragged lengths."""
    rs = np.random.RandomState(seed)
    tokens = rs.randint(3, 256, (rows, T))
    mask = np.zeros((rows, T), np.float32)
    for b in range(rows):
        first = 4 + b % 3
        mask[b, first:first + 3 + b % 4] = 1  # first agent turn
        second = 14 + b % 2
        mask[b, second:second + 1 + b % 5] = 1  # second agent turn, then env tokens up to T
    scores = rs.rand(rows).astype(np.float32)
    groups = np.repeat(np.arange(rows // 4), 4)
    old_logp = np.where(mask > 0, -rs.rand(rows, T) * 3 - 2, 0.0)
    return TrajectoryBatch.create(tokens, mask, scores, groups, old_logp=old_logp)


def _params(learner: Learner) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(learner.policy_state)}


def _assert_trees_close(a: dict, b: dict, atol: float, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=atol, rtol=rtol, err_msg=key)


# --------------------------------------------------------------------------------------------------------------
# Configuration and bad input
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(advantage_estimator="ppo"), "advantage_estimator: Unknown advantage estimator 'ppo'; valid names: gae, gigpo, grpo"),
        (dict(loss_aggregation="mean"), "loss_aggregation: Unknown loss aggregation 'mean'; valid names: seq-mean"),
        (dict(kl_estimator="k4"), "kl_estimator: Unknown KL estimator 'k4'; valid names: k1, k2, k3"),
        (dict(lr_schedule="step"), "lr_schedule: unknown value 'step'; valid values: constant, cosine, linear"),
        (dict(lr_schedule="cosine"), "needs total_steps"),
        (dict(clip_ratio_c=0.9), "clip_ratio_c must be > 1"),
        (dict(minibatch_size=6, microbatch_size=4), "minibatch_size=6 must be a multiple of microbatch_size=4"),
        (dict(use_reference=False), "kl_coef=0.001 needs the reference policy"),
        (dict(kl_in_reward=True), "kl_in_reward=True is supported by the token-level estimators"),
        (dict(ppo_epochs=0), "ppo_epochs must be >= 1"),
        (dict(compute_dtype="fp8"), "unknown dtype 'fp8'"),
    ],
)
def test_bad_config_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LearnerConfig(**overrides).validate()


def test_defaults_are_the_original_grpo_recipe():
    config = LearnerConfig()
    config.validate()
    assert (config.advantage_estimator, config.learning_rate, config.lr_schedule) == ("grpo", 1e-6, "constant")
    assert (config.b1, config.b2, config.weight_decay, config.grad_clip_norm) == (0.9, 0.999, 0.01, 1.0)
    assert (config.clip_low, config.clip_high, config.kl_estimator, config.kl_coef) == (0.2, 0.2, "k3", 0.001)
    assert (config.entropy_coef, config.loss_aggregation, config.ppo_epochs) == (0.001, "seq-mean-token-mean", 1)


def test_batch_validation_errors():
    good = _batch()
    with pytest.raises(BatchError, match=r"loss_mask\[:, 0\] must be 0"):
        mask = np.array(good.loss_mask)
        mask[0, 0] = 1
        TrajectoryBatch.create(good.tokens, mask, good.scores, good.group_ids)
    with pytest.raises(BatchError, match=r"scores must be \[B\] = \(8,\)"):
        TrajectoryBatch.create(good.tokens, good.loss_mask, good.scores[:3], good.group_ids)
    with pytest.raises(BatchError, match="loss_mask must hold only 0 and 1"):
        TrajectoryBatch.create(good.tokens, good.loss_mask * 0.5, good.scores, good.group_ids)
    padded = good.pad_rows(12)
    assert padded.num_rows == 12 and padded.valid.tolist() == [1] * 8 + [0] * 4
    assert padded.num_agent_tokens() == good.num_agent_tokens()


def test_learner_rejects_bad_batches(model_dir):
    learner = Learner(hf.load_model(model_dir), LearnerConfig(minibatch_size=8))
    good = _batch()
    empty = TrajectoryBatch.create(good.tokens, np.zeros_like(good.loss_mask), good.scores, good.group_ids)
    with pytest.raises(BatchError, match="loss mask is all zero"):
        learner.update(empty, jax.random.PRNGKey(0))
    all_padding = TrajectoryBatch.create(good.tokens, good.loss_mask, good.scores, good.group_ids, valid=np.zeros(B))
    with pytest.raises(BatchError, match="loss mask is all zero"):
        learner.update(all_padding, jax.random.PRNGKey(0))
    with pytest.raises(BatchError, match=r"12 rows, not a multiple of minibatch_size=8; pad it with batch.pad_rows\(16\)"):
        learner.update(_batch(rows=12), jax.random.PRNGKey(0))
    rloo = Learner(hf.load_model(model_dir), LearnerConfig(advantage_estimator="rloo"))
    singletons = TrajectoryBatch.create(good.tokens, good.loss_mask, good.scores, np.arange(B))
    with pytest.raises(BatchError, match="fewer than 2 trajectories"):
        rloo.update(singletons, jax.random.PRNGKey(0))
    mesh_learner = Learner(hf.load_model(model_dir), LearnerConfig(microbatch_size=2), mesh=sharding.make_mesh((4, 2, 1)))
    with pytest.raises(BatchError, match="micro-batch size: batch of 2 rows is not divisible by data x fsdp = 8"):
        mesh_learner.update(good, jax.random.PRNGKey(0))


# --------------------------------------------------------------------------------------------------------------
# Pure pieces
# --------------------------------------------------------------------------------------------------------------


def test_schedule_warmup_then_cosine():
    schedule = learning_rate_schedule(1e-3, 10, "cosine", 110)
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(5e-4)
    assert float(schedule(10)) == pytest.approx(1e-3)
    assert float(schedule(60)) == pytest.approx(5e-4, rel=1e-5)
    assert float(schedule(110)) == pytest.approx(0.0, abs=1e-9)


def test_token_logprobs_alignment_and_chunking(model_dir):
    model = hf.load_model(model_dir)
    tokens = jnp.asarray(_batch().tokens)
    logp, entropy = token_logprobs(model, tokens)
    full = jax.nn.log_softmax(model(tokens), axis=-1)
    expected = np.take_along_axis(np.asarray(full[:, :-1]), np.asarray(tokens[:, 1:, None]), -1)[..., 0]
    np.testing.assert_allclose(np.asarray(logp[:, 1:]), expected, atol=1e-5)
    assert np.all(np.asarray(logp[:, 0]) == 0) and np.all(np.asarray(entropy[:, 0]) == 0)
    for chunk in (5, 8):  # 5 does not divide T=24: padded internally
        chunked_logp, chunked_entropy = token_logprobs(model, tokens, chunk_size=chunk)
        np.testing.assert_allclose(np.asarray(chunked_logp), np.asarray(logp), atol=1e-5)
        np.testing.assert_allclose(np.asarray(chunked_entropy), np.asarray(entropy), atol=1e-5)
    hot_logp, _ = token_logprobs(model, tokens, temperature=0.5)
    hot_full = jax.nn.log_softmax(model(tokens) / 0.5, axis=-1)
    hot_expected = np.take_along_axis(np.asarray(hot_full[:, :-1]), np.asarray(tokens[:, 1:, None]), -1)[..., 0]
    np.testing.assert_allclose(np.asarray(hot_logp[:, 1:]), hot_expected, atol=1e-5)


def test_critic_starts_from_the_policy_backbone(model_dir):
    model = hf.load_model(model_dir)
    critic = Critic.from_policy(model)
    np.testing.assert_array_equal(
        np.asarray(critic.model.layers[1].mlp.down_proj.kernel[...]), np.asarray(model.model.layers[1].mlp.down_proj.kernel[...])
    )
    assert critic.model.embed_tokens.weight[...] is not model.model.embed_tokens.weight[...]  # its own buffers
    tokens = jnp.asarray(_batch().tokens)
    assert np.all(np.asarray(critic.values(tokens)) == 0.0)  # zero head
    critic.value_head.bias.set_value(jnp.ones((1,)))
    critic.value_head.kernel.set_value(jnp.full((64, 1), 0.1))
    hidden, _ = model.forward(tokens)
    expected = np.asarray(hidden[:, :-1].sum(-1) * 0.1 + 1.0)
    np.testing.assert_allclose(np.asarray(critic.values(tokens))[:, 1:], expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# Gradients flow only through agent tokens
# --------------------------------------------------------------------------------------------------------------


def _micro(batch: TrajectoryBatch, rs: np.random.RandomState) -> TrainingBatch:
    mask = batch.loss_mask
    advantages = jnp.asarray(np.where(mask > 0, rs.randn(*mask.shape), 0.0), jnp.float32)
    return TrainingBatch(
        tokens=jnp.asarray(batch.tokens), positions=None, loss_mask=jnp.asarray(mask),
        old_logp=jnp.asarray(batch.old_logp), advantages=advantages, returns=advantages,
        scores=jnp.asarray(batch.scores), valid=jnp.asarray(batch.valid),
        ref_logp=jnp.asarray(np.where(mask > 0, -rs.rand(*mask.shape) * 3 - 2, 0.0), jnp.float32),
    )


def test_env_position_logits_get_no_gradient_and_change_nothing(model_dir):
    model = hf.load_model(model_dir)
    config = LearnerConfig(entropy_coef=0.01, kl_coef=0.1)
    batch = _batch()
    micro = _micro(batch, np.random.RandomState(1))
    denominator = loss_denominator(config.loss_aggregation, micro.loss_mask)
    logits = model(micro.tokens)

    def loss_of_logits(logits):
        logp, entropy = token_logprobs_from_logits(logits, micro.tokens)
        return policy_loss_terms(logp, entropy, micro, denominator, config)[0]

    loss_of_logits = jax.jit(loss_of_logits)
    grads = np.asarray(jax.jit(jax.grad(loss_of_logits))(logits))
    # The logits at position t-1 produce token t: they matter exactly where loss_mask[t] == 1.
    predicts_agent_token = np.zeros((B, T), bool)
    predicts_agent_token[:, :-1] = batch.loss_mask[:, 1:] > 0
    assert np.all(grads[~predicts_agent_token] == 0.0)
    assert np.all(np.abs(grads[predicts_agent_token]).sum(-1) > 0)
    noise = jnp.asarray(np.random.RandomState(2).randn(*logits.shape) * 50.0 * ~predicts_agent_token[..., None])
    assert float(loss_of_logits(logits + noise)) == float(loss_of_logits(logits))


def test_env_tokens_and_values_at_env_positions_change_no_loss_or_gradient(model_dir):
    model = hf.load_model(model_dir)
    config = LearnerConfig(entropy_coef=0.01, kl_coef=0.1)
    batch = _batch()
    micro = _micro(batch, np.random.RandomState(1))
    graphdef, params = nnx.split(model)
    denominator = loss_denominator(config.loss_aggregation, micro.loss_mask)

    @jax.jit
    def loss_and_grads(micro):
        return jax.value_and_grad(lambda p: policy_loss(nnx.merge(graphdef, p), micro, denominator, config)[0])(params)

    loss, grads = loss_and_grads(micro)
    rs = np.random.RandomState(3)
    env = np.asarray(micro.loss_mask) == 0
    last_agent = T - 1 - np.argmax(np.asarray(micro.loss_mask)[:, ::-1] > 0, axis=1)
    after_last = np.arange(T)[None, :] > last_agent[:, None]  # trailing observation tokens: context of nothing
    noise = {key: jnp.where(env, jnp.asarray(rs.randn(B, T) * 100.0, jnp.float32), getattr(micro, key))
             for key in ("old_logp", "ref_logp", "advantages")}
    perturbed = dataclasses.replace(micro, tokens=jnp.where(after_last, rs.randint(3, 256, (B, T)), micro.tokens),
                                    **noise)
    perturbed_loss, perturbed_grads = loss_and_grads(perturbed)
    assert float(perturbed_loss) == float(loss)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(perturbed_grads)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # An agent token's advantage does move the loss (the test above is not vacuous).
    moved = dataclasses.replace(micro, advantages=micro.advantages + 0.5 * micro.loss_mask)
    assert abs(float(loss_and_grads(moved)[0]) - float(loss)) > 1e-3


# --------------------------------------------------------------------------------------------------------------
# Exact gradient accumulation
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_accumulated_gradient_equals_full_batch_gradient(model_dir, aggregation):
    batch = _batch()
    base = dict(loss_aggregation=aggregation, entropy_coef=0.01, kl_coef=0.1)
    full, full_aux = Learner(hf.load_model(model_dir), LearnerConfig(**base)).gradients(batch)
    split, split_aux = Learner(hf.load_model(model_dir), LearnerConfig(microbatch_size=2, **base)).gradients(batch)
    assert full_aux["total_loss"] == pytest.approx(split_aux["total_loss"], abs=1e-6)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(split)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=1e-5)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(full)) > 1e-3


def test_accumulated_update_equals_full_batch_update(model_dir):
    batch = _batch()
    # Adam's first step is lr * g / (|g| + eps): a parameter whose exact gradient is 0 (the k_proj bias, as
    # softmax ignores a shift shared by all keys) moves by lr times normalized fp32 rounding noise, whatever the
    # accumulation. lr=1e-4 keeps that below the 1e-6 tolerance; the gradients themselves match above.
    base = dict(learning_rate=1e-4, advantage_estimator="gae", lam=0.95, critic_learning_rate=1e-4)
    results = []
    for micro in (None, 2):
        learner = Learner(hf.load_model(model_dir), LearnerConfig(microbatch_size=micro, **base))
        metrics = learner.update(batch, jax.random.PRNGKey(0))
        critic = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(learner.critic_state)}
        results.append((_params(learner), critic, metrics))
    (p1, c1, m1), (p2, c2, m2) = results
    _assert_trees_close(p1, p2, atol=1e-6)
    _assert_trees_close(c1, c2, atol=1e-6)
    for key in ("total_loss", "value_loss", "grad_norm", "critic_grad_norm", "clip_frac"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), key
    assert m1["optimizer_updates"] == 1 and m1["step"] == 1


# --------------------------------------------------------------------------------------------------------------
# Updates: minibatches and epochs, NaN skipping, compile count, checkpoints
# --------------------------------------------------------------------------------------------------------------


def test_nan_update_is_skipped_and_reported(model_dir, caplog):
    config = LearnerConfig(learning_rate=1e-3, old_logp_source="sampler", minibatch_size=4, ppo_epochs=2)
    learner = Learner(hf.load_model(model_dir), config)
    before = _params(learner)
    bad = _batch()
    old_logp = np.array(bad.old_logp)
    rows, cols = np.nonzero(bad.loss_mask)
    old_logp[rows[0], cols[0]] = np.nan  # one agent token of row 0
    bad = TrajectoryBatch.create(bad.tokens, bad.loss_mask, bad.scores, bad.group_ids, old_logp=old_logp)
    with caplog.at_level(logging.WARNING, logger="agentgym_jax.learner"):
        metrics = learner.update(bad, jax.random.PRNGKey(0))
    # Row 0 sits in one of the two minibatches of each epoch: 2 of the 4 updates are skipped.
    assert metrics["skipped_updates"] == 2 and metrics["optimizer_updates"] == 2 and learner.step == 2
    assert "skipped 2 of 4 optimizer updates" in caplog.text
    assert np.isfinite([v for v in _params(learner)["model.norm.weight"]]).all()
    fresh = Learner(hf.load_model(model_dir), config)
    all_bad = np.where(bad.loss_mask > 0, np.nan, 0.0)
    fresh_before = _params(fresh)
    metrics = fresh.update(
        TrajectoryBatch.create(bad.tokens, bad.loss_mask, bad.scores, bad.group_ids, old_logp=all_bad),
        jax.random.PRNGKey(0),
    )
    assert metrics["skipped_updates"] == 4 and fresh.step == 0
    for key, value in _params(fresh).items():
        np.testing.assert_array_equal(value, fresh_before[key], err_msg=key)  # untouched, bit for bit
    assert any(np.abs(_params(learner)[k] - before[k]).max() > 0 for k in before)  # the good updates moved


def test_epochs_minibatches_compile_once_and_checkpoint_resume(model_dir):
    compile_stats.install()
    config = LearnerConfig(learning_rate=1e-3, minibatch_size=4, microbatch_size=2, ppo_epochs=3)
    learner = Learner(hf.load_model(model_dir), config)
    before = compile_stats.compilations(TRAIN_STEP_NAME)
    metrics = learner.update(_batch(0), jax.random.PRNGKey(0))
    assert metrics["optimizer_updates"] == 6 and learner.step == 6 and metrics["skipped_updates"] == 0
    assert metrics["lr"] == pytest.approx(1e-3)
    saved = jax.device_get(learner.checkpoint_state())
    assert saved["step"] == 6 and any(k.startswith("reference/") for k in saved)
    after_first = learner.update(_batch(1), jax.random.PRNGKey(1))
    assert compile_stats.compilations(TRAIN_STEP_NAME) - before == 1  # one program for every minibatch and call
    resumed = Learner(hf.load_model(model_dir), config)
    resumed.restore_checkpoint_state(saved)
    assert resumed.step == 6
    again = resumed.update(_batch(1), jax.random.PRNGKey(1))
    _assert_trees_close(_params(resumed), _params(learner), atol=0.0)
    assert again["total_loss"] == after_first["total_loss"]
    # The policy really moved away from the reference, and the resumed reference is the original one.
    ref = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(resumed.reference_state)}
    original = _params(Learner(hf.load_model(model_dir), LearnerConfig()))
    _assert_trees_close(ref, original, atol=0.0)
    assert after_first["ref_kl"] > 0


def test_padding_rows_are_ignored(model_dir):
    plain = Learner(hf.load_model(model_dir), LearnerConfig(learning_rate=1e-4))  # lr: see the accumulation test
    plain_metrics = plain.update(_batch(), jax.random.PRNGKey(0))
    padded_batch = _batch().pad_rows(16)
    # Garbage in the padding rows must not matter.
    padded_batch = TrajectoryBatch(
        tokens=np.where(padded_batch.valid[:, None] > 0, padded_batch.tokens, 7), loss_mask=np.where(
            padded_batch.valid[:, None] > 0, padded_batch.loss_mask, np.pad(np.ones((16, T - 1)), ((0, 0), (1, 0)))),
        old_logp=padded_batch.old_logp, scores=np.where(padded_batch.valid > 0, padded_batch.scores, 100.0),
        group_ids=padded_batch.group_ids, valid=padded_batch.valid,
    )
    padded = Learner(hf.load_model(model_dir), LearnerConfig(learning_rate=1e-4, minibatch_size=16))
    padded_metrics = padded.update(padded_batch, jax.random.PRNGKey(0))
    _assert_trees_close(_params(padded), _params(plain), atol=1e-6)
    assert padded_metrics["trajectories"] == 8 and padded_metrics["scores/mean"] == pytest.approx(plain_metrics["scores/mean"])


# --------------------------------------------------------------------------------------------------------------
# Meshes and mixed precision
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, estimator", [((2, 2, 2), "grpo"), ((4, 1, 2), "gae")])
def test_mesh_update_matches_single_device(model_dir, shape, estimator):
    assert jax.device_count() == 8, "tests/conftest.py sets 8 simulated devices"
    config = LearnerConfig(learning_rate=1e-3, advantage_estimator=estimator, critic_learning_rate=1e-3,
                           minibatch_size=8, microbatch_size=4, entropy_coef=0.01, kl_coef=0.1)
    batch = _batch()
    single = Learner(hf.load_model(model_dir), config)
    single_metrics = single.update(batch, jax.random.PRNGKey(0))
    mesh = sharding.make_mesh(shape)
    sharded = Learner(hf.load_model(model_dir, mesh=mesh), config, mesh=mesh)
    sharded_metrics = sharded.update(batch, jax.random.PRNGKey(0))
    kernel = sharded.policy_state["model"]["layers"][0]["mlp"]["up_proj"]["kernel"][...]
    expected = sharding.param_sharding(mesh, "model.layers.0.mlp.up_proj.kernel", kernel.shape)
    assert kernel.sharding.is_equivalent_to(expected, kernel.ndim)
    assert kernel.addressable_shards[0].data.shape[1] == kernel.shape[1] // shape[2]  # still split after the update
    _assert_trees_close(_params(sharded), _params(single), atol=2e-5)
    for key in ("total_loss", "grad_norm", "entropy", "approx_kl"):
        assert sharded_metrics[key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key
    if estimator == "gae":
        assert sharded_metrics["value_loss"] == pytest.approx(single_metrics["value_loss"], rel=1e-4)
        head = sharded.critic_state["value_head"]["kernel"][...]
        assert head.sharding.is_equivalent_to(sharding.param_sharding(mesh, "value_head.kernel", head.shape), 2)


def test_bf16_compute_keeps_fp32_master_params(model_dir):
    batch = _batch()
    fp32 = Learner(hf.load_model(model_dir), LearnerConfig(learning_rate=1e-3))
    bf16 = Learner(hf.load_model(model_dir), LearnerConfig(learning_rate=1e-3, compute_dtype="bfloat16", remat=True,
                                                           logprob_chunk_size=8))
    fp32_metrics = fp32.update(batch, jax.random.PRNGKey(0))
    bf16_metrics = bf16.update(batch, jax.random.PRNGKey(0))
    assert all(v.dtype == np.float32 for v in _params(bf16).values())
    assert bf16.policy_model().config.dtype == "float32"  # export view keeps the model's own numerics
    assert bf16_metrics["entropy"] == pytest.approx(fp32_metrics["entropy"], rel=1e-2)
    assert bf16_metrics["grad_norm"] == pytest.approx(fp32_metrics["grad_norm"], rel=5e-2)


@pytest.mark.parametrize("chunk", [None, 8])
def test_logprobs_read_only_at_agent_positions_equal_the_full_computation(model_dir, chunk):
    from agentgym_jax.learner import agent_positions

    model = hf.load_model(model_dir)
    batch = _batch(3)
    positions = agent_positions(batch.loss_mask)
    assert positions.shape == (B, 16) and (positions >= 0).sum() == int(batch.loss_mask.sum())
    full_logp, full_entropy = token_logprobs(model, jnp.asarray(batch.tokens), 0.7, None)
    logp, entropy = token_logprobs(model, jnp.asarray(batch.tokens), 0.7, chunk, jnp.asarray(positions[:, :12]
                                                                                            if chunk else positions))
    on = np.asarray(batch.loss_mask) > 0
    if chunk:  # 12 columns do not cover every row's agent tokens: uncovered positions read 0
        covered = np.zeros_like(on)
        for row, cols in enumerate(positions[:, :12]):
            covered[row, cols[cols >= 0]] = True
        on = covered
    np.testing.assert_allclose(np.asarray(logp)[on], np.asarray(full_logp)[on], atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy)[on], np.asarray(full_entropy)[on], atol=1e-5)
    assert not np.asarray(logp)[~on].any() and not np.asarray(entropy)[~on].any()


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_a_dropped_learner_frees_its_arrays_at_once(model_dir, estimator):
    """No reference cycle keeps a learner (its parameters, optimizer state, programs) alive after its last
    reference goes: programs hold module functions, not the learner's bound methods."""
    import gc
    import weakref

    gc.collect()
    gc.disable()  # a cycle would now stay alive
    try:
        learner = Learner(hf.load_model(model_dir), LearnerConfig(minibatch_size=8, advantage_estimator=estimator,
                                                                   old_logp_source="sampler"))
        learner.update(_batch(), jax.random.PRNGKey(0))
        learner.gradients(_batch())
        alive = weakref.ref(learner)
        params = [weakref.ref(x) for x in jax.tree.leaves(learner.policy_state)]
        del learner
        assert alive() is None
        assert all(p() is None for p in params)
    finally:
        gc.enable()
