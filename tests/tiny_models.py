"""Tiny random Hugging Face models built locally with transformers, for parity tests."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name -> (family, overrides). Covers tied/untied, GQA ratio 1 and >1, QKV bias on/off, rope scaling on/off.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mha-untied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama3-rope-scaling": ("llama", dict(num_key_value_heads=2, rope_scaling=LLAMA3_ROPE)),
    "llama-linear-rope-bias": ("llama", dict(num_key_value_heads=1, attention_bias=True,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2-gqa-untied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2-mha-tied": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    # Qwen3: q/k RMSNorm, no QKV bias, head_dim (32) decoupled from hidden_size / heads (16), theta 1e6.
    "qwen3-gqa-tied": ("qwen3", dict(num_key_value_heads=2, tie_word_embeddings=True, head_dim=32,
                                     rope_theta=1_000_000.0)),
    "qwen3-mha-untied-bias": ("qwen3", dict(num_key_value_heads=4, tie_word_embeddings=False, attention_bias=True)),
    # Llama-3.2: tied embeddings with Llama-3 rope scaling (factor 32).
    "llama32-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500_000.0,
                                   rope_scaling=dict(LLAMA3_ROPE, factor=32.0))),
}
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def make_hf_model(variant: str, seed: int = 0, **extra: Any):
    """A random transformers causal LM (fp32, eager attention) of the named variant."""
    import torch
    import transformers

    family, overrides = VARIANTS[variant]
    config_cls = getattr(transformers, CONFIG_CLASSES[family])
    kwargs = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    )
    kwargs.update(overrides)
    kwargs.update(extra)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    # Norm weights start at 1 in HF; perturb them so the test exercises their loading too.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def save_hf_model(variant: str, directory: str | Path | None = None, **extra: Any) -> Path:
    """Saves a random model of ``variant`` to ``directory`` (a new temp dir by default); returns the path."""
    directory = Path(directory or tempfile.mkdtemp(prefix=f"tiny-{variant}-"))
    make_hf_model(variant, **extra).save_pretrained(directory)
    return directory


CHATML_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CORPUS = [
    "Reply with one word.", "Task 3: say a word.", "Turn 1 noted. Another word.", "You are a bot.",
    "apple banana cherry dog egg fig grape hat ice jam kite lemon melon nut orange pear queen rose sun tree",
    "umbrella violin water xylophone yak zebra go to red ball pick up the key open door",
]


def save_tiny_chat_model(directory: str | Path, seed: int = 0, vocab_size: int = 320) -> Path:
    """A tiny random Llama with a small byte-level BPE ChatML tokenizer trained here, for loop tests.

    The small vocabulary lets a random policy's preferences move within a few RL steps.
    """
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS * 10, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    directory = Path(directory)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory
