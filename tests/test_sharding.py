"""The same model on 1 device and on 8 simulated CPU devices under several meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import hf, sharding
from agentgym_jax.errors import ConfigError
from tests.tiny_models import save_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model("qwen2-mha-tied", tmp_path_factory.mktemp("qwen2"))


def _logits(model, ids, mesh=None):
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    with sharding.use_mesh(mesh):
        if mesh is not None:
            ids = jax.device_put(ids, sharding.named_sharding(mesh, "tokens"))
        return np.asarray(forward(state, ids))


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_meshes_match_single_device(model_dir, shape):
    assert jax.device_count() == 8, "tests/conftest.py sets 8 simulated devices"
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 256, (8, 24)))
    single = _logits(hf.load_model(model_dir), ids)
    mesh = sharding.make_mesh(shape)
    model = hf.load_model(model_dir, mesh=mesh)
    kernel = model.model.layers[0].mlp.up_proj.kernel[...]
    assert kernel.sharding.spec == sharding.param_spec("model.layers.0.mlp.up_proj.kernel")
    if shape[2] > 1:  # really split, not replicated
        assert kernel.addressable_shards[0].data.shape[1] == kernel.shape[1] // shape[2]
    sharded = _logits(model, ids, mesh)
    np.testing.assert_allclose(sharded, single, atol=2e-5, rtol=1e-5)


def test_mesh_that_does_not_divide_names_the_dimension(model_dir):
    mesh = sharding.make_mesh((1, 1, 8))
    with pytest.raises(ConfigError, match="num_attention_heads=4 .* 'tensor' axis of size 8"):
        hf.load_model(model_dir, mesh=mesh)


def test_mesh_shape_must_match_device_count():
    with pytest.raises(ConfigError, match="needs 4 devices but 8"):
        sharding.make_mesh((2, 2, 1))


def test_every_parameter_has_a_rule(model_dir):
    model = hf.load_model(model_dir)
    for path in _param_paths(model):
        sharding.param_spec(path)  # raises if a parameter lacks a rule


def _param_paths(model):
    return [".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
