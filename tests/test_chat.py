"""Chat rendering: ids equal the template's tokenization, role masks, incremental turns, the sampler protocol."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agentgym_jax import default_model
from agentgym_jax.chat import ChatTokenizer, Role, TokenizedChat
from agentgym_jax.errors import TokenizerError

# A Qwen2.5-style ChatML template written for these tests: a default system prompt when none is given.
QWEN_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set turns = messages[1:] %}{%- else %}"
    "{%- set system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
    "{%- set turns = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- for m in turns %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A Llama-3-style template: BOS, header tokens, trimmed contents, <|eot_id|> ends every turn.
LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]

CONVERSATION = [
    {"role": "user", "content": "You are in a room. Goal: open the door.\nWhat do you do?"},
    {"role": "assistant", "content": "Thought: look first.\nAction: look around"},
    {"role": "user", "content": "  You see a red door and a key. \n"},
    {"role": "assistant", "content": "Action: pick up key"},
    {"role": "user", "content": "You picked up the key."},
    {"role": "assistant", "content": " Action: open door"},
]
SYSTEM = {"role": "system", "content": "You are an agent in a text world."}


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    return default_model.prepare_default_model()


@pytest.fixture(scope="session")
def smol(smol_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def tiny_fast_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here on a few sentences, with ChatML and Llama-3 special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for m in CONVERSATION] * 20 + ["system user assistant You are Qwen, a helpful agent."] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with only a sentencepiece ``tokenizer.model`` (trained here) and a ChatML template."""
    import sentencepiece

    directory = tmp_path_factory.mktemp("sentencepiece")
    model = io.BytesIO()
    corpus = [m["content"] for m in CONVERSATION] * 20 + ["system user assistant Hello Hi agent world"] * 20
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": False, "legacy": False, "chat_template": chatml}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="session", params=["smollm2", "qwen_style_on_smollm2", "qwen_style_tiny", "llama3_style_tiny",
                                         "sentencepiece_chatml"])
def chat(request: pytest.FixtureRequest, smol: ChatTokenizer, tiny_fast_tokenizer, sentencepiece_dir) -> ChatTokenizer:
    if request.param == "sentencepiece_chatml":
        return ChatTokenizer.from_pretrained(sentencepiece_dir)
    if request.param == "smollm2":
        return smol
    if request.param == "qwen_style_on_smollm2":
        return ChatTokenizer(smol.tokenizer, chat_template=QWEN_STYLE_TEMPLATE)
    if request.param == "qwen_style_tiny":
        return ChatTokenizer(tiny_fast_tokenizer, chat_template=QWEN_STYLE_TEMPLATE)
    return ChatTokenizer(tiny_fast_tokenizer, chat_template=LLAMA3_STYLE_TEMPLATE)


def _hf_ids(chat: ChatTokenizer, messages, add_generation_prompt=False) -> list[int]:
    return list(chat.tokenizer.apply_chat_template(messages, chat_template=chat.chat_template, tokenize=True,
                                                   add_generation_prompt=add_generation_prompt, return_dict=False))


def _runs(rendered: TokenizedChat) -> list[tuple[int, list[int]]]:
    """Maximal runs of equal, non-glue roles as (role, ids)."""
    runs: list[tuple[int, list[int]]] = []
    for token, role in zip(rendered.ids.tolist(), rendered.roles.tolist()):
        if role == Role.GLUE:
            runs.append((Role.GLUE, []))
        elif runs and runs[-1][0] == role:
            runs[-1][1].append(token)
        else:
            runs.append((role, [token]))
    return [run for run in runs if run[0] != Role.GLUE]


@pytest.mark.parametrize("with_system", [False, True])
def test_render_equals_template_tokenization_and_roles_recover_contents(chat: ChatTokenizer, with_system: bool) -> None:
    messages = ([SYSTEM] if with_system else []) + CONVERSATION
    rendered = chat.render(messages)
    assert rendered.ids.tolist() == _hf_ids(chat, messages)
    runs = _runs(rendered)
    assert [Role(role).name.lower() for role, _ in runs] == [m["role"] for m in messages]
    trims = chat.chat_template is LLAMA3_STYLE_TEMPLATE
    for (role, ids), message in zip(runs, messages):
        content = message["content"].strip() if trims else message["content"]
        if role == Role.ASSISTANT:
            assert ids[-1] == chat.end_of_turn_id, "assistant run must end with its end-of-turn token"
            ids = ids[:-1]
        # A token straddling glue and content (e.g. "\n  " before "  You see") counts as content, and
        # sentencepiece decoders drop a fragment's leading space: compare up to surrounding whitespace.
        assert chat.decode(ids).strip() == content.strip()
    mask = rendered.assistant_content_mask
    assert mask.dtype == np.int32
    assert int(mask.sum()) == sum(len(ids) for role, ids in runs if role == Role.ASSISTANT)
    assert int(((rendered.ids == chat.end_of_turn_id) & (mask == 1)).sum()) == 3


def test_token_straddling_glue_and_content_belongs_to_the_content(smol: ChatTokenizer) -> None:
    rendered = smol.render([{"role": "user", "content": "  spaced"}])
    tokens = smol.tokenizer.convert_ids_to_tokens(rendered.ids.tolist())
    straddler = tokens.index("ĊĠ")  # "\n " : the glue newline merged with the first content space
    assert tokens[straddler - 1] == "user" and rendered.roles[straddler] == Role.USER
    assert smol.decode(rendered.ids[rendered.roles == Role.USER]) == "\n  spaced"


def test_smollm2_glue_and_default_system_prompt(smol: ChatTokenizer) -> None:
    assert smol.generation_prompt_ids == (1, 520, 9531, 198)  # "<|im_start|>assistant\n"
    assert smol.assistant_end_ids == (2, 198)  # "<|im_end|>\n"
    assert smol.end_of_turn_id == 2
    rendered = smol.render(CONVERSATION[:1], add_generation_prompt=True)
    text = smol.decode(rendered.ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.roles[-4:].tolist() == [Role.GLUE] * 4


@pytest.mark.parametrize("with_system", [False, True])
def test_incremental_turns_equal_full_render(chat: ChatTokenizer, with_system: bool) -> None:
    messages = ([SYSTEM] if with_system else []) + CONVERSATION
    built = chat.render(messages[:1])
    for k in range(1, len(messages)):
        built = built + chat.render_turn(messages[:k], messages[k])
        full = chat.render(messages[: k + 1])
        assert built.ids.tolist() == full.ids.tolist()
        assert built.roles.tolist() == full.roles.tolist()
    user_turn = {"role": "user", "content": "The door is open."}
    with_prompt = chat.render(messages) + chat.render_turn(messages, user_turn, add_generation_prompt=True)
    assert with_prompt.ids.tolist() == _hf_ids(chat, messages + [user_turn], add_generation_prompt=True)
    assert with_prompt.ids[-len(chat.generation_prompt_ids):].tolist() == list(chat.generation_prompt_ids)


def test_sampler_protocol_keeps_sampled_ids_and_matches_full_render(chat: ChatTokenizer) -> None:
    history = [SYSTEM, CONVERSATION[0]]
    sequence = chat.render(history, add_generation_prompt=True)
    for k in (1, 3, 5):
        reply = CONVERSATION[k]
        sampled = chat.encode_in_turn(reply["content"].strip()) + [chat.end_of_turn_id]
        sequence = sequence + chat.assistant_turn(sampled, include_generation_prompt=False)
        history = history + [{"role": "assistant", "content": reply["content"].strip()}]
        expected = chat.render(history)
        assert sequence.ids.tolist() == expected.ids.tolist()
        assert sequence.roles.tolist() == expected.roles.tolist()
        if k < 5:
            observation = CONVERSATION[k + 1]
            sequence = sequence + chat.render_turn(history, observation, add_generation_prompt=True)
            history = history + [observation]
    assert chat.decode_assistant(sampled) == CONVERSATION[5]["content"].strip()


def test_encode_in_turn_matches_in_context_tokens(sentencepiece_dir: Path, smol: ChatTokenizer) -> None:
    spm_chat = ChatTokenizer.from_pretrained(sentencepiece_dir)
    standalone, in_turn = spm_chat.encode("look around"), spm_chat.encode_in_turn("look around")
    assert spm_chat.tokenizer.convert_ids_to_tokens(standalone)[0].startswith("▁")  # word-boundary marker
    assert standalone != in_turn
    full = spm_chat.render([CONVERSATION[0], {"role": "assistant", "content": "look around"}])
    assert full.ids[full.roles == Role.ASSISTANT].tolist()[:-1] == in_turn
    assert smol.encode_in_turn("look around") == smol.encode("look around")


def test_truncated_sample_gets_a_glue_end_of_turn(smol: ChatTokenizer) -> None:
    sampled = smol.encode("Action: open the")
    turn = smol.assistant_turn(sampled)
    assert turn.ids.tolist() == [1, 520, 9531, 198, *sampled, 2, 198]
    assert turn.assistant_content_mask.tolist() == [0] * 4 + [1] * len(sampled) + [0, 0]
    finished = smol.assistant_turn(sampled + [2], include_generation_prompt=False)
    assert finished.ids.tolist() == [*sampled, 2, 198]
    assert finished.assistant_content_mask.tolist() == [1] * (len(sampled) + 1) + [0]


def test_stop_tokens(smol: ChatTokenizer, tiny_fast_tokenizer) -> None:
    assert 2 in smol.stop_token_ids and "<|im_end|>" in smol.stop_strings
    llama3 = ChatTokenizer(tiny_fast_tokenizer, chat_template=LLAMA3_STYLE_TEMPLATE)
    eot = tiny_fast_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert llama3.end_of_turn_id == eot and eot in llama3.stop_token_ids and "<|eot_id|>" in llama3.stop_strings
    assert llama3.assistant_end_ids == (eot,)
    assert smol.decode_assistant(smol.encode("go north") + [2]) == "go north"
    assert smol.pad_token_id == 2


def test_template_depending_on_later_turns_is_rejected(smol: ChatTokenizer) -> None:
    template = (
        "{%- if messages|length > 2 %}{{- '<|im_start|>system\\nLong chat.<|im_end|>\\n' }}{%- endif %}"
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    chat = ChatTokenizer(smol.tokenizer, chat_template=template)
    chat.render_turn(CONVERSATION[:1], CONVERSATION[1])
    with pytest.raises(TokenizerError, match="not prefix-consistent"):
        chat.render_turn(CONVERSATION[:2], CONVERSATION[2])


# Written for these tests after Qwen3's documented behaviour: an assistant turn's <think> block is split off its
# content and shown only for turns after the last user query (always for the last message); with
# enable_thinking=false the generation prompt carries an empty think block.
QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)


def _rollout_render(chat: ChatTokenizer, conversation: list[dict]) -> tuple[TokenizedChat, list[list[int]]]:
    """What a rollout builds: the prompt, then sampled ids kept verbatim and each next turn appended."""
    first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    sequence = chat.render(conversation[:first], add_generation_prompt=True)
    history, sampled_turns = list(conversation[:first]), []
    for message in conversation[first:]:
        if message["role"] == "assistant":
            sampled = chat.encode_in_turn(message["content"]) + [chat.end_of_turn_id]
            sampled_turns.append(sampled)
            sequence = sequence + chat.assistant_turn(sampled, include_generation_prompt=False)
        else:
            sequence = sequence + chat.render_turn(history, message, add_generation_prompt=True)
        history.append(message)
    return sequence, sampled_turns


# Qwen2/Qwen3's pre-tokenization: a run of line breaks is one piece whatever follows it ("</think>\n\n" then the
# reply), unlike GPT-2's, which splits the last break off before a word.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def qwen_style_tokenizer(smol_dir: Path) -> PreTrainedTokenizerFast:
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.mark.parametrize("thinking", [False, True])
def test_qwen3_style_conversation_renders_incrementally_as_sampled(qwen_style_tokenizer, thinking: bool) -> None:
    kwargs = {} if thinking else {"enable_thinking": False}
    chat = ChatTokenizer(qwen_style_tokenizer, chat_template=QWEN3_STYLE_TEMPLATE, template_kwargs=kwargs)
    assert chat.rewrites_history
    assert chat.generation_prompt_text == "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    replies = (["<think>\nThe door is shut.\n</think>\n\nAction: look around", "<think>\nkey\n</think>\n\nAction: "
                "pick up key"] if thinking else ["Action: look around", "Action: pick up key"])
    conversation = [SYSTEM, CONVERSATION[0], {"role": "assistant", "content": replies[0]}, CONVERSATION[2],
                    {"role": "assistant", "content": replies[1]}, CONVERSATION[4]]
    sequence, sampled_turns = _rollout_render(chat, conversation)
    full = chat.render(conversation, add_generation_prompt=True)
    assert list(full.ids) == list(sequence.ids) and list(full.roles) == list(sequence.roles)
    # The sampled ids are in the sequence verbatim and are exactly what is marked as assistant output.
    assert [int(i) for i in sequence.ids[sequence.roles == Role.ASSISTANT]] == sum(sampled_turns, [])
    text = chat.decode(sequence.ids)
    assert text.count("<think>") == 2 + (0 if thinking else 1)  # every turn as the model saw it
    # The template's own full render shows earlier turns differently: that is what is never trained on.
    assert chat.render_text(conversation, add_generation_prompt=True) != text
    # Each turn is also a prefix of the next: the KV cache of an episode stays valid.
    shorter = chat.render(conversation[:4], add_generation_prompt=True)
    assert list(full.ids[: len(shorter)]) == list(shorter.ids)


def test_template_that_alters_replies_is_rejected_at_construction(smol: ChatTokenizer) -> None:
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}" \
               "{% if add_generation_prompt %}assistant: {% endif %}"
    with pytest.raises(TokenizerError, match="assistant message as generation prompt"):
        ChatTokenizer(smol.tokenizer, chat_template=template)


def test_template_without_generation_prompt_is_rejected(smol: ChatTokenizer) -> None:
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with pytest.raises(TokenizerError, match="no add_generation_prompt block"):
        ChatTokenizer(smol.tokenizer, chat_template=template)


def test_tokenizer_without_chat_template(smol_dir: Path, tmp_path: Path) -> None:
    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smol_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no chat template.*chat_template"):
        ChatTokenizer.from_pretrained(tmp_path)


def test_missing_tokenizer_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        ChatTokenizer.from_pretrained(tmp_path / "nothing")
    with pytest.raises(TokenizerError, match="cannot load a tokenizer"):
        ChatTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "messages,match",
    [
        ("hello", "must be a list"),
        ([{"role": "user"}], "message 0 must be a dict with 'role' and 'content'"),
        ([{"role": "robot", "content": "x"}], "message 0 has role 'robot'"),
        ([{"role": "user", "content": ["x"]}], "message 0 content must be a string"),
    ],
)
def test_bad_messages(smol: ChatTokenizer, messages, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        smol.render(messages)


def test_stop_strings_become_the_token_sequences_a_model_writes(smol: ChatTokenizer) -> None:
    sequences = smol.stop_sequences(("</search>", "</answer>"))
    decoded = {smol.tokenizer.decode(list(s)) for s in sequences}
    assert decoded == {"</search>", " </search>", "</answer>", " </answer>"}
    for text in ("<search>capital of France</search>", "query </search>"):  # how it appears inside a turn
        ids = smol.tokenizer.encode(text, add_special_tokens=False)
        assert any(tuple(ids[-len(s):]) == s for s in sequences), text
    with pytest.raises(TokenizerError, match="empty stop string"):
        smol.stop_sequences(("",))
