"""Training only the top layers: frozen layers keep their exact values, the rest learn as without freezing."""

import jax
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import freezing, hf
from agentgym_jax.errors import ConfigError
from agentgym_jax.learner import Learner, LearnerConfig
from tests.test_learner import _batch, _params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_models import save_hf_model

    return save_hf_model("qwen2-mha-tied", tmp_path_factory.mktemp("qwen2-freeze"))


def _learner(model_dir, **overrides):
    config = LearnerConfig(learning_rate=1e-2, kl_coef=0.0, use_reference=False, entropy_coef=0.0, **overrides)
    return Learner(hf.load_model(model_dir), config)


def test_frozen_layers_do_not_move_and_top_layers_match_full_gradient(model_dir):
    full, top = _learner(model_dir), _learner(model_dir, trainable_layers=1)
    layers = top.policy_model().config.num_hidden_layers
    assert layers >= 2
    before = _params(top)
    batch = _batch(0)
    full_grads, _ = full.gradients(batch)
    top_grads, _ = top.gradients(batch)
    top.update(batch, jax.random.PRNGKey(0))
    after = _params(top)
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    for key in before:
        index = freezing.layer_index(tuple(key.split(".")))
        if index is not None and index < layers - 1:
            assert key not in moved, key  # weight decay would have moved it without the mask
        elif index == layers - 1:
            assert key in moved, key
    # The top layer's gradient is the full model's gradient for those parameters (stop_gradient only cuts below).
    flat_full = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(full_grads)}
    flat_top = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(top_grads)}
    checked = 0
    for key, value in flat_top.items():
        index = freezing.layer_index(tuple(key.split(".")))
        if index == layers - 1:
            np.testing.assert_allclose(value, flat_full[key], atol=1e-6, rtol=1e-5, err_msg=key)
            checked += 1
        elif index is not None:
            assert not np.any(value), key
    assert checked >= 5


@pytest.mark.parametrize("pack_rows", [False, True])
def test_a_cached_trunk_gives_the_updates_of_the_whole_forward(model_dir, pack_rows):
    """With the embeddings frozen too, the frozen layers' output is computed once per step (prepare) and every
    update starts from it: the same parameters after two epochs of minibatch updates as computing every layer in
    every update; the embeddings and the frozen layers keep their values."""
    from tests.test_packing import _group_batch

    config = dict(trainable_layers=1, freeze_embeddings=True, minibatch_size=8, microbatch_size=4, ppo_epochs=2,
                  old_logp_source="sampler")
    if pack_rows:
        config.update(pack_rows=True, group_minibatches=True, loss_aggregation="token-mean")
    batch = _group_batch(groups=4) if pack_rows else _batch(0)
    cached, whole = _learner(model_dir, **config), _learner(model_dir, **config)
    whole._trunk = None  # every update runs the embedding and the frozen layers itself
    assert cached.prepare(batch).trunk is not None and whole.prepare(batch).trunk is None
    before = _params(cached)
    metrics = cached.update(batch, jax.random.PRNGKey(0))
    reference = whole.update(batch, jax.random.PRNGKey(0))
    assert metrics["optimizer_updates"] == reference["optimizer_updates"] == (4 if pack_rows else 2)
    np.testing.assert_allclose(metrics["total_loss"], reference["total_loss"], rtol=1e-4, atol=1e-6)
    after, expected = _params(cached), _params(whole)
    layers = cached.policy_model().config.num_hidden_layers
    moved, apart, total = 0, 0, 0
    for key, value in after.items():
        # Adam's steps of 1e-2 amplify float rounding where a gradient is near 0 (the two programs' products may
        # sum in other orders): 5e-4 is 2% of a median step, and almost every entry agrees to 1e-5 (below).
        np.testing.assert_allclose(value, expected[key], atol=5e-4, rtol=0, err_msg=key)
        apart += int((np.abs(value - expected[key]) > 1e-5).sum())
        total += value.size
        index = freezing.layer_index(tuple(key.split(".")))
        if "embed_tokens" in key or (index is not None and index < layers - 1):
            np.testing.assert_array_equal(value, before[key], err_msg=key)
        moved += np.abs(value - before[key]).max() > 1e-2
    assert moved >= 5  # the top layer and the final norm learned, by far more than the tolerance
    assert apart < 0.005 * total, (apart, total)  # measured with packed rows: 136 of 99,008 (4 with einsum attention)


def test_packed_rows_compute_the_trunk_once_per_shared_prompt_with_the_same_values(model_dir):
    """With pack_rows the frozen layers run over the batch packed (each group's prompt once): the trunk a loss
    reads (every token up to a row's last agent token) equals the padded rows' up to rounding, for half the
    positions here."""
    from tests.test_packing import _group_batch

    config = dict(trainable_layers=1, freeze_embeddings=True, minibatch_size=8, microbatch_size=4,
                  old_logp_source="sampler", loss_aggregation="token-mean")
    batch = _group_batch(groups=4)
    packed, padded = _learner(model_dir, pack_rows=True, group_minibatches=True, **config), _learner(model_dir, **config)
    computed = {"packed": 0, "padded": 0}
    for name, learner in (("packed", packed), ("padded", padded)):
        def counting(policy, tokens, *rest, trunk=learner._trunk, name=name):
            computed[name] += tokens.size
            return trunk(policy, tokens, *rest)
        learner._trunk = counting
    mine, theirs = packed.prepare(batch).trunk, padded.prepare(batch).trunk
    assert computed["padded"] == 16 * 32 and computed["packed"] <= 0.5 * computed["padded"]
    for row, on in enumerate(np.asarray(batch.loss_mask) > 0):
        end = int(np.flatnonzero(on)[-1]) + 1
        np.testing.assert_allclose(mine[row, :end], theirs[row, :end], atol=2e-5, rtol=1e-4, err_msg=str(row))
        assert not mine[row, end:].any()  # past the last agent token: never read, not computed
    assert np.abs(theirs).max() > 0.1


def test_without_frozen_embeddings_the_trunk_is_not_cached(model_dir):
    """A trained (tied) embedding table changes the frozen layers' input after every update: no cache."""
    learner = _learner(model_dir, trainable_layers=1)
    assert learner.prepare(_batch(0)).trunk is None


def test_labels_and_bad_counts():
    params = {"model": {"layers": {0: {"w": 1.0}, 1: {"w": 2.0}}, "norm": {"scale": 3.0}}}
    assert freezing.labels(params, 1) == {"model": {"layers": {0: {"w": "frozen"}, 1: {"w": "train"}},
                                                    "norm": {"scale": "train"}}}
    embedded = {"model": {"embed_tokens": {"embedding": 0.0}, "layers": {0: {"w": 1.0}}}}
    assert freezing.labels(embedded, 0, freeze_embeddings=True) == {
        "model": {"embed_tokens": {"embedding": "frozen"}, "layers": {0: {"w": "train"}}}}
    assert freezing.labels(embedded, 0)["model"]["embed_tokens"]["embedding"] == "train"
    assert freezing.frozen_layer_count(30, 8) == 22
    assert freezing.frozen_layer_count(30, 0) == 0
    with pytest.raises(ConfigError, match="exceeds the model's 30 decoder layers"):
        freezing.frozen_layer_count(30, 31)
    with pytest.raises(ConfigError, match="trainable_layers applies to the policy only"):
        LearnerConfig(advantage_estimator="gae", trainable_layers=2).validate()
