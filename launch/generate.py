"""Chat with a policy model from the command line: render the chat template, sample a reply, print it.

Usage:
  python -m launch.generate --prompt="What is 2+2?"
  python -m launch.generate --model=/path/to/hf_dir_or.gguf --chat_file=chat.json --temperature=0

``--model`` defaults to the project's SmolLM2-135M-Instruct (converted on first use). ``--chat_file`` is a
JSON list of ``{"role": ..., "content": ...}`` messages; ``--prompt`` is one user message (with an optional
``--system`` message). Generation stops at the template's end of turn (``<|im_end|>``), an EOS id or
``--max_new_tokens``. The reply goes to stdout; timing and the stop reason go to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

from launch.common import run

_MODEL = flags.DEFINE_string("model", "", "Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct).")
_PROMPT = flags.DEFINE_string("prompt", None, "One user message.")
_SYSTEM = flags.DEFINE_string("system", None, "Optional system message placed before --prompt.")
_CHAT_FILE = flags.DEFINE_string("chat_file", None, "JSON file holding a list of {role, content} messages.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 256, "Most tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.7, "Sampling temperature; 0 is greedy.")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass in (0, 1]; 1 disables it.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep only the k most likely tokens; 0 disables it.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed (same seed, same reply).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and compute dtype.")


class GenerateError(Exception):
    """Bad command-line input (missing prompt, unreadable chat file, bad model path)."""


def read_messages(prompt: str | None, system: str | None, chat_file: str | None) -> list[dict[str, Any]]:
    """The conversation to answer, from ``--prompt``/``--system`` or ``--chat_file`` (exactly one source)."""
    if (prompt is None) == (chat_file is None):
        raise GenerateError("give exactly one of --prompt=TEXT or --chat_file=PATH.json")
    if prompt is not None:
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": "user", "content": prompt}]
    if system is not None:
        raise GenerateError("--system goes with --prompt; put the system message inside --chat_file instead")
    path = Path(chat_file)
    if not path.is_file():
        raise GenerateError(f"--chat_file={chat_file} does not exist; pass a JSON file with a list of messages")
    try:
        messages = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise GenerateError(f"--chat_file={chat_file} is not valid JSON ({err})") from err
    if not isinstance(messages, list) or not messages:
        raise GenerateError(f'--chat_file={chat_file} must hold a non-empty JSON list like [{{"role": "user", "content": "Hi"}}]')
    return messages


def load_chat_tokenizer(model_path: Path) -> Any:
    """The chat tokenizer of a model directory, or of a ``.gguf`` file (its embedded tokenizer and template)."""
    from agentgym_jax.chat import ChatTokenizer

    if model_path.is_dir():
        return ChatTokenizer.from_pretrained(model_path)
    from agentgym_jax import gguf

    checkpoint = gguf.open_gguf(model_path)
    eos = checkpoint.config.get("eos_token_id")
    return ChatTokenizer(
        checkpoint.load_tokenizer(), chat_template=checkpoint.chat_template,
        extra_stop_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
    )


def resolve_model_path(model: str) -> Path:
    """``--model`` as a path, or the default model's directory when empty."""
    if not model:
        from agentgym_jax.default_model import prepare_default_model

        return prepare_default_model()
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise GenerateError(f"--model={model} is a file but not a .gguf; pass a Hugging Face directory or a .gguf file")
    raise GenerateError(f"--model={model} does not exist; pass a Hugging Face model directory or a .gguf file")


def generate_reply(
    model_path: Path, messages: list[dict[str, Any]], *, max_new_tokens: int, temperature: float, top_p: float,
    top_k: int, seed: int, dtype: str,
) -> tuple[str, dict[str, Any]]:
    """Samples the assistant's reply to ``messages``; returns its text and a summary of the run."""
    import jax

    from agentgym_jax import hf
    from agentgym_jax.buckets import bucket
    from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams

    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens)
    params.validate()
    chat = load_chat_tokenizer(model_path)
    prompt = chat.render(messages, add_generation_prompt=True).ids.tolist()
    model = hf.load_model(model_path, param_dtype=dtype, dtype=dtype)
    context = model.config.max_position_embeddings
    if len(prompt) + max_new_tokens > context:
        raise GenerateError(f"the prompt ({len(prompt)} tokens) plus --max_new_tokens={max_new_tokens} exceeds the "
                            f"model's context of {context} tokens; shorten the conversation or lower --max_new_tokens")
    config = SamplerConfig(
        cache_length=bucket(len(prompt) + max_new_tokens, SamplerConfig.token_buckets, "prompt + --max_new_tokens"),
        stop_token_ids=chat.stop_token_ids,
    )
    sampler = Sampler(model, config)
    start = time.perf_counter()
    _, result = sampler.generate(sampler.new_state(1), [prompt], jax.random.PRNGKey(seed), params)
    seconds = time.perf_counter() - start
    tokens = result.tokens[0]
    summary = dict(
        prompt_tokens=len(prompt), new_tokens=len(tokens), stop_reason=result.stop_reasons[0].name,
        seconds_including_compile=round(seconds, 2),
    )
    return chat.decode_assistant(tokens), summary


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from agentgym_jax.errors import AgentGymError

    try:
        messages = read_messages(_PROMPT.value, _SYSTEM.value, _CHAT_FILE.value)
        model_path = resolve_model_path(_MODEL.value)
        reply, summary = generate_reply(
            model_path, messages, max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
            top_p=_TOP_P.value, top_k=_TOP_K.value, seed=_SEED.value, dtype=_DTYPE.value,
        )
    except (GenerateError, AgentGymError) as err:
        sys.exit(f"error: {err}")
    print(reply)
    print(json.dumps(summary), file=sys.stderr)


if __name__ == "__main__":
    run(main)
