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


def test_labels_and_bad_counts():
    params = {"model": {"layers": {0: {"w": 1.0}, 1: {"w": 2.0}}, "norm": {"scale": 3.0}}}
    assert freezing.labels(params, 1) == {"model": {"layers": {0: {"w": "frozen"}, 1: {"w": "train"}},
                                                    "norm": {"scale": "train"}}}
    assert freezing.frozen_layer_count(30, 8) == 22
    assert freezing.frozen_layer_count(30, 0) == 0
    with pytest.raises(ConfigError, match="exceeds the model's 30 decoder layers"):
        freezing.frozen_layer_count(30, 31)
    with pytest.raises(ConfigError, match="trainable_layers applies to the policy only"):
        LearnerConfig(advantage_estimator="gae", trainable_layers=2).validate()
