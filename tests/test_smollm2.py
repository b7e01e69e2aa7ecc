"""SmolLM2-135M-Instruct (the default model): logits, greedy generation and export against transformers."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from agentgym_jax import hf
from agentgym_jax.chat import ChatTokenizer
from agentgym_jax.default_model import default_gguf_path, prepare_default_model
from agentgym_jax.sampling import Sampler, SamplerConfig, SamplingParams, StopReason
from launch import generate as generate_cli

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors and say why they are called primary."}],
    [{"role": "user", "content": "Write one sentence about the sea, then one about the mountains, then stop."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir():
    return prepare_default_model()


@pytest.fixture(scope="module")
def ours(model_dir):
    return hf.load_model(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat(model_dir):
    return ChatTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompts(chat, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = []
    for messages in CHATS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        assert ids == chat.render(messages, add_generation_prompt=True).ids.tolist()
        rendered.append(ids)
    assert len({len(p) for p in rendered}) == 3, "the prompts must have different lengths"
    return rendered


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_logits_match_transformers_and_gguf_load(ours, reference, prompts):
    ids = prompts[1]
    expected = _torch_logits(reference, ids)
    logits = np.asarray(ours(jnp.asarray([ids])))[0]
    assert logits.shape == (len(ids), 49152)
    assert np.max(np.abs(logits - expected)) <= 1e-3
    from_gguf = hf.load_model(default_gguf_path())
    np.testing.assert_allclose(np.asarray(from_gguf(jnp.asarray([ids])))[0], logits, atol=1e-5, rtol=0)


def _reference_greedy(reference, prompt, stop_id):
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=stop_id, pad_token_id=stop_id,
        )[0, len(prompt):].tolist()
    return out[: out.index(stop_id) + 1] if stop_id in out else out


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
WINDOWED = dict(cache_length=256, window_buckets=(64, 96, 128, 192))


def test_greedy_batch_matches_transformers_generate(ours, reference, prompts, chat):
    """32 free-running greedy tokens (whole-cache attention), then stopping on <|im_end|> (live window)."""
    im_end = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    free = Sampler(ours, SamplerConfig(cache_length=256))
    _, unstopped = free.generate(free.new_state(3), prompts, jax.random.PRNGKey(0), GREEDY)
    stopping = Sampler(ours, SamplerConfig(stop_token_ids=(im_end,), **WINDOWED))
    assert stopping.window(np.zeros(3, np.int64), np.array([len(p) for p in prompts]), [NEW_TOKENS] * 3) < 256
    _, stopped = stopping.generate(stopping.new_state(3), prompts, jax.random.PRNGKey(0), GREEDY)
    saw_stop = False
    for prompt, free_tokens, tokens, reason in zip(prompts, unstopped.tokens, stopped.tokens, stopped.stop_reasons):
        # eos_token_id=None falls back to the model's eos (<|im_end|>); an id no token has disables stopping.
        no_stop = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[-1], pad_token_id=im_end)
        with torch.no_grad():
            expected_free = reference.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                generation_config=no_stop,
            )[0, len(prompt):].tolist()
        assert len(free_tokens) == NEW_TOKENS and free_tokens == expected_free
        expected = _reference_greedy(reference, prompt, im_end)
        assert tokens == expected
        if tokens[-1] == im_end:
            saw_stop = True
            assert reason == StopReason.STOP_TOKEN
        else:
            assert reason == StopReason.MAX_TOKENS and len(tokens) == NEW_TOKENS
    assert saw_stop, "at least one prompt should end its turn with <|im_end|> within 32 tokens"


def test_live_window_extend_equals_teacher_forcing(ours, prompts, chat):
    """Two turns through the live window: tokens are the argmax and log-probs the log-softmax of a full forward."""
    im_end = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = Sampler(ours, SamplerConfig(stop_token_ids=(im_end,), **WINDOWED))
    state, first = sampler.generate(sampler.new_state(3), prompts, jax.random.PRNGKey(0), GREEDY)
    follow_up = chat.render_turn(CHATS[0], {"role": "user", "content": "Say it again."}, add_generation_prompt=True)
    # Only what is new after the sampled ids: the end-of-turn glue, the user's follow-up, the generation prompt.
    appended = [chat.assistant_turn(t, include_generation_prompt=False).ids.tolist()[len(t):] + follow_up.ids.tolist()
                for t in first.tokens]
    state, second = sampler.generate(state, appended, jax.random.PRNGKey(1), SamplingParams(0.0, max_new_tokens=16))
    for b, prompt in enumerate(prompts):
        history = prompt + first.tokens[b] + appended[b]
        sequence = history + second.tokens[b]
        assert state.lengths[b] == len(sequence)
        logits = np.asarray(ours(jnp.asarray([sequence])))[0]
        logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
        start = len(history)
        positions = range(start - 1, len(sequence) - 1)
        assert second.tokens[b] == [int(np.argmax(logits[t])) for t in positions]
        np.testing.assert_allclose(second.logprobs[b], [logp[t, sequence[t + 1]] for t in positions], atol=1e-4)


def test_export_loads_in_transformers_without_warnings(ours, model_dir, prompts, tmp_path):
    out = hf.export_model(ours, tmp_path / "export", tokenizer_dir=model_dir)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tokenizer.chat_template
    ids = prompts[0]
    expected = np.asarray(ours(jnp.asarray([ids])))[0]
    np.testing.assert_allclose(_torch_logits(loaded.eval(), ids), expected, atol=1e-3, rtol=0)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2]


def test_generate_cli_greedy_reply(model_dir, reference, prompts, chat):
    reply, summary = generate_cli.generate_reply(
        model_dir, CHATS[0], max_new_tokens=NEW_TOKENS, temperature=0.0, top_p=1.0, top_k=0, seed=0, dtype="float32"
    )
    expected = _reference_greedy(reference, prompts[0], 2)
    assert reply == chat.decode_assistant(expected)
    assert summary["prompt_tokens"] == len(prompts[0]) and summary["new_tokens"] == len(expected)


def test_generate_cli_input_errors(tmp_path):
    with pytest.raises(generate_cli.GenerateError, match="exactly one of --prompt"):
        generate_cli.read_messages(None, None, None)
    with pytest.raises(generate_cli.GenerateError, match="does not exist"):
        generate_cli.read_messages(None, None, str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(generate_cli.GenerateError, match="not valid JSON"):
        generate_cli.read_messages(None, None, str(tmp_path / "bad.json"))
    with pytest.raises(generate_cli.GenerateError, match="does not exist"):
        generate_cli.resolve_model_path(str(tmp_path / "no_model"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(generate_cli.GenerateError, match="not a .gguf"):
        generate_cli.resolve_model_path(str(tmp_path / "weights.bin"))
    assert generate_cli.read_messages("hi", "sys", None) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}
    ]
