"""GGUF reading (tiny files written here, and the bundled SmolLM2) and the default model conversion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from agentgym_jax import default_model
from agentgym_jax.errors import CheckpointError
from agentgym_jax.gguf import gguf_name_to_hf, open_gguf, read_gguf, unpermute_rotary

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2 directory in the default cache (converted on first use, ~10 s)."""
    return default_model.prepare_default_model()


# ----- tiny GGUF files ------------------------------------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """The interleaving llama.cpp's converter applies to q/k rows (the inverse of ``unpermute_rotary``)."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


_HF_TO_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _to_gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[rest]}"


def _write_gguf(path: Path, arch: str, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    writer.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    writer.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    writer.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    writer.add_uint32(f"{arch}.attention.head_count", config["num_attention_heads"])
    writer.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 3)
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_hf_model(arch: str, tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="eager"))
    elif arch == "qwen3":  # head_dim 32, decoupled from hidden_size / heads = 16
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, attn_implementation="eager"))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, attn_implementation="eager"))
    with torch.no_grad():  # give norms and biases non-trivial values so a mix-up shows in the logits
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                param.copy_(torch.randn_like(param) * 0.5 + (1.0 if "norm" in name else 0.0))
    return model.eval()


def _gguf_from_hf(model: torch.nn.Module, arch: str, path: Path) -> Path:
    config = model.config.to_dict()
    config["rope_theta"] = 10000.0
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        array = value.numpy()
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, config["num_attention_heads"])
        if arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, config["num_key_value_heads"])
        tensors[_to_gguf_name(name)] = array
    return _write_gguf(path, arch, config, tensors)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False),
                                       ("qwen3", True), ("qwen3", False)])
def test_tiny_gguf_round_trip_gives_identical_logits(tmp_path: Path, arch: str, tied: bool) -> None:
    model = _tiny_hf_model(arch, tied)
    path = _gguf_from_hf(model, arch, tmp_path / "tiny.gguf")
    checkpoint = open_gguf(path)
    config = checkpoint.config
    assert config["model_type"] == arch and config["tie_word_embeddings"] is tied
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        4, 2, 32 if arch == "qwen3" else 16)
    assert config["rms_norm_eps"] == 1e-6 and config["eos_token_id"] == 3
    reference = model.state_dict()
    expected_names = {n for n in reference if not (tied and n == "lm_head.weight")}
    assert set(checkpoint.tensor_names()) == expected_names
    for name, array in checkpoint.iter_tensors():
        assert array.dtype == np.float32 and checkpoint.tensor_shape(name) == array.shape
        np.testing.assert_array_equal(array, reference[name].numpy(), err_msg=name)
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    rebuilt = model_class(config_class(**config, attn_implementation="eager")).eval()
    state = {name: torch.from_numpy(array) for name, array in checkpoint.iter_tensors()}
    missing, unexpected = rebuilt.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= ({"lm_head.weight"} if tied else set())
    if tied:
        rebuilt.tie_weights()
    ids = torch.arange(1, 17).reshape(1, 16) % 96
    with torch.no_grad():
        diff = (rebuilt(ids).logits - model(ids).logits).abs().max().item()
    assert diff == 0.0


LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _llama_cpp_rope_factors(theta: float, head_dim: int, rope: dict) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama-3 rope scaling, from the formula its converter applies."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelength = 2 * np.pi / inv_freq
    original, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (original / wavelength - low) / (high - low)
    factors = np.where(wavelength < original / high, 1.0, np.where(
        wavelength > original / low, rope["factor"], 1 / ((1 - smooth) / rope["factor"] + smooth)))
    return factors.astype(np.float32)


def test_llama32_gguf_rope_parameters_are_recovered_from_rope_freqs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_scaling=dict(LLAMA32_ROPE), attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    hf_config = model.config.to_dict()
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        array = value.numpy()
        if ".q_proj." in name:
            array = _llama_cpp_permute(array, 2)
        if ".k_proj." in name:
            array = _llama_cpp_permute(array, 1)
        tensors[_to_gguf_name(name)] = array
    tensors["rope_freqs.weight"] = _llama_cpp_rope_factors(500000.0, 64, LLAMA32_ROPE)
    hf_config["rope_theta"] = 500000.0
    path = _write_gguf(tmp_path / "llama32.gguf", "llama", hf_config, tensors)
    checkpoint = open_gguf(path)
    assert checkpoint.config["rope_scaling"] == LLAMA32_ROPE
    assert "rope_freqs.weight" not in checkpoint.tensor_names()
    from agentgym_jax import hf as hf_io

    ours = hf_io.load_model(path)
    ids = np.arange(1, 41).reshape(1, 40) % 96
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.numpy()
    import jax.numpy as jnp

    assert np.abs(np.asarray(ours(jnp.asarray(ids))) - expected).max() <= 1e-4
    # Factors that do not follow the llama3 formula are refused, not guessed.
    tensors["rope_freqs.weight"] = np.linspace(1, 7, 32).astype(np.float32)
    with pytest.raises(CheckpointError, match="rope_freqs"):
        open_gguf(_write_gguf(tmp_path / "odd.gguf", "llama", hf_config, tensors))


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((6 * 8, 5)).astype(np.float32)
    permuted = _llama_cpp_permute(weight, 6)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rotary(permuted, 6), weight)
    bias = rng.standard_normal(6 * 8).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rotary(_llama_cpp_permute(bias, 3), 3), bias)


def test_name_mapping() -> None:
    assert gguf_name_to_hf("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert gguf_name_to_hf("output.weight") == "lm_head.weight"
    with pytest.raises(CheckpointError, match="ffn_gate_exps"):
        gguf_name_to_hf("blk.0.ffn_gate_exps.weight")


# ----- bad input -------------------------------------------------------------------------------------


@pytest.fixture()
def tiny_gguf(tmp_path: Path) -> Path:
    return _gguf_from_hf(_tiny_hf_model("llama", False), "llama", tmp_path / "tiny.gguf")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        open_gguf(tmp_path / "absent.gguf")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text('{"not": "gguf"}')
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        open_gguf(path)


@pytest.mark.parametrize("keep_fraction", [0.5, 0.95])
def test_truncated_tensor_data(tiny_gguf: Path, keep_fraction: float) -> None:
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(CheckpointError, match="truncated"):
        open_gguf(tiny_gguf)


def test_truncated_header(tiny_gguf: Path) -> None:
    tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        open_gguf(tiny_gguf)


def test_unsupported_architecture(tmp_path: Path) -> None:
    config = dict(num_hidden_layers=1, max_position_embeddings=8, hidden_size=8, intermediate_size=8,
                  num_attention_heads=2, num_key_value_heads=2, rope_theta=1e4, rms_norm_eps=1e-5)
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", config, {"token_embd.weight": np.zeros((4, 8))})
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'gpt2'"):
        open_gguf(path)


def test_mixture_of_experts_tensor_is_rejected(tmp_path: Path) -> None:
    config = dict(num_hidden_layers=1, max_position_embeddings=8, hidden_size=8, intermediate_size=8,
                  num_attention_heads=2, num_key_value_heads=2, rope_theta=1e4, rms_norm_eps=1e-5)
    tensors = {"token_embd.weight": np.zeros((4, 8)), "blk.0.ffn_gate_exps.weight": np.zeros((2, 8, 8))}
    with pytest.raises(CheckpointError, match="no Hugging Face equivalent"):
        open_gguf(_write_gguf(tmp_path / "moe.gguf", "llama", config, tensors))


# ----- the bundled SmolLM2 ---------------------------------------------------------------------------


def test_bundled_gguf_config_and_tensors() -> None:
    checkpoint = open_gguf(default_model.default_gguf_path())
    config = checkpoint.config
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "vocab_size", "max_position_embeddings")} == {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192}
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 1e5
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    names = checkpoint.tensor_names()
    assert len(names) == 272 and "lm_head.weight" not in names
    assert sum(int(np.prod(checkpoint.tensor_shape(n))) for n in names) == 134_515_008
    assert checkpoint.tensor_shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)
    assert "<|im_start|>" in checkpoint.chat_template


def test_read_gguf_returns_config_iterator_tokenizer() -> None:
    config, tensors, tokenizer = read_gguf(default_model.default_gguf_path())
    name, first = next(tensors)
    assert config["vocab_size"] == len(tokenizer) == 49152
    assert name == "model.embed_tokens.weight" and first.shape == (49152, 576)
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_default_model_directory_contents(default_model_dir: Path) -> None:
    assert default_model_dir == default_model.default_model_dir()
    for name in default_model.REQUIRED_FILES:
        assert (default_model_dir / name).is_file(), name
    tensors = load_file(default_model_dir / "model.safetensors")
    assert len(tensors) == 272 and all(t.dtype == np.float32 for t in tensors.values())
    assert sum(t.size for t in tensors.values()) == 134_515_008
    assert (default_model_dir / "model.safetensors").stat().st_size == pytest.approx(538e6, rel=0.01)
    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and "<|im_start|>assistant" in tokenizer_config["chat_template"]
    assert json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == [2]


def test_default_model_loads_in_transformers_with_gguf_identical_logits(default_model_dir: Path) -> None:
    ours, info = AutoModelForCausalLM.from_pretrained(default_model_dir, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert ours.config.tie_word_embeddings is True
    source = default_model.default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 19556, 665, 2, 198, 1, 520,
                         9531, 198]])
    with torch.no_grad():
        ours_logits, reference_logits = ours(ids).logits, reference(ids).logits
    assert ours_logits.abs().max().item() > 1.0
    assert (ours_logits - reference_logits).abs().max().item() <= 1e-5


def test_prepare_is_idempotent(default_model_dir: Path) -> None:
    stamp = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    assert default_model.prepare_default_model() == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_cache_env_var_and_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(default_model.CACHE_ENV_VAR, str(tmp_path / "cache"))
    target = default_model.default_model_dir()
    assert target == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"

    def interrupted(source: Path, out_dir: Path) -> None:
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        default_model.prepare_default_model()
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [".SmolLM2-135M-Instruct.lock"]


def test_incomplete_directory_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(default_model.CACHE_ENV_VAR, str(tmp_path))
    target = default_model.default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a half directory from some older tool

    def fake_convert(source: Path, out_dir: Path) -> None:
        for name in default_model.REQUIRED_FILES:
            (Path(out_dir) / name).write_text("x")

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", fake_convert)
    assert default_model.prepare_default_model() == target
    assert default_model.is_complete(target) and (target / "config.json").read_text() == "x"
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == [".SmolLM2-135M-Instruct.lock", target.name]


def test_cli_prints_directory(default_model_dir: Path) -> None:
    env = {**os.environ, default_model.CACHE_ENV_VAR: str(default_model_dir.parents[1])}
    result = subprocess.run([sys.executable, "-m", "launch.prepare_model"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == str(default_model_dir)
