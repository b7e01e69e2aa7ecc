"""Bad checkpoints get clear errors that name the problem."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from agentgym_jax import hf
from agentgym_jax.errors import CheckpointError, ConfigError
from tests.tiny_models import save_hf_model


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return save_hf_model("llama-gqa-tied", tmp_path_factory.mktemp("good"))


def _copy(good_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(good_dir, target)
    return target


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="has no config.json"):
        hf.load_model(tmp_path)


def test_path_that_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        hf.load_model(tmp_path / "nope")


@pytest.mark.parametrize("model_type,arch", [("mixtral", "MixtralForCausalLM"), ("gpt2", "GPT2LMHeadModel")])
def test_unsupported_architecture(good_dir, tmp_path, model_type, arch):
    target = _copy(good_dir, tmp_path)
    config = json.loads((target / "config.json").read_text())
    config.update(model_type=model_type, architectures=[arch])
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"unsupported architecture model_type='{model_type}'"):
        hf.load_model(target)


def _edited_checkpoint(good_dir, tmp_path, edit):
    """A copy of the good checkpoint whose tensors ``edit(tensors)`` changed in place."""
    target = _copy(good_dir, tmp_path)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"),
     r"lacks 1 tensor.*model\.layers\.1\.mlp\.down_proj\.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 64), np.float32)}),
     r"k_proj\.weight .* has shape \(8, 64\), expected \(32, 64\)"),
    (lambda t: t.update({"model.layers.0.extra.weight": np.zeros((2,), np.float32)}), "does not use"),
], ids=["missing", "wrong-shape", "unexpected"])
def test_bad_tensors(good_dir, tmp_path, edit, match):
    with pytest.raises(CheckpointError, match=match):
        hf.load_model(_edited_checkpoint(good_dir, tmp_path, edit))


def test_truncated_safetensors(good_dir, tmp_path):
    target = _copy(good_dir, tmp_path)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="safetensors"):
        hf.load_model(target)


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        hf.load_model(fake)


def test_bad_dtype_name(good_dir):
    with pytest.raises(ConfigError, match="unknown dtype 'fp8'"):
        hf.load_model(good_dir, param_dtype="fp8")


@pytest.mark.parametrize("rope,missing", [
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
     "low_freq_factor"),
    ({"rope_type": "linear"}, "factor"),
])
def test_rope_parameters_are_checked_at_load_time(good_dir, tmp_path, rope, missing):
    target = _copy(good_dir, tmp_path)
    config = json.loads((target / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = rope
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"rope type '{rope['rope_type']}' needs \\['{missing}'\\]"):
        hf.load_model(target)
