"""Chat rendering: a Hugging Face tokenizer plus its chat template -> token ids with a per-token role.

Roles say who produced each token:

* ``Role.SYSTEM`` / ``Role.USER`` / ``Role.ASSISTANT`` / ``Role.TOOL``: the content of a message with that
  role (environment observations are ``USER`` turns).
* ``Role.GLUE``: everything the chat template adds around contents: role headers such as
  ``<|im_start|>assistant\\n``, separators, BOS, default system prompts, the newline after ``<|im_end|>``.
* Exception: the end-of-turn stop token that directly follows an assistant message's content
  (``<|im_end|>``, ``<|eot_id|>``) is ``Role.ASSISTANT``: the model emits it to end its turn, so it is
  trained on. ``TokenizedChat.assistant_content_mask`` is 1 exactly on assistant contents plus that token.

Tokens are the tokenizer's encoding of the full rendered text, exactly what
``tokenizer.apply_chat_template(messages, tokenize=True)`` returns; roles come from character offsets
(a token overlapping a content span belongs to that content).

Incremental use in a rollout (the sampled ids are never re-encoded)::

    chat = ChatTokenizer.from_pretrained(model_dir)
    seq = chat.render([system, user], add_generation_prompt=True)       # ends with "<|im_start|>assistant\\n"
    sampled = sampler(seq.ids, stop_token_ids=chat.stop_token_ids)      # e.g. [..., <|im_end|>]
    seq = seq + chat.assistant_turn(sampled, include_generation_prompt=False)   # closes the turn
    seq = seq + chat.render_turn(history, {"role": "user", "content": obs}, add_generation_prompt=True)

``render_turn`` guarantees ``render(h) + render_turn(h, m) == render(h + [m])``.

Templates that rewrite earlier assistant turns once a new query follows (Qwen3 drops their ``<think>`` blocks)
are detected at construction (``rewrites_history``). For them a conversation is rendered the way a model sampling
turn by turn sees it: assistant contents are kept as generated (encoded in turn, think blocks included) and each
other message is the template's glue and content that follow the previous turn. So the tokens trained on are the
tokens sampled, and ``render`` equals the incremental rendering; the template's own full render (which would show
earlier turns differently) is never used for such conversations. ``template_kwargs`` (e.g.
``{"enable_thinking": False}``) are passed to the template on every render.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentgym_jax.errors import TokenizerError

Message = Mapping[str, Any]


class Role(enum.IntEnum):
    """Who produced a token (see the module docstring)."""

    GLUE = 0
    SYSTEM = 1
    USER = 2
    ASSISTANT = 3
    TOOL = 4


ROLE_BY_NAME = {"system": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT, "tool": Role.TOOL}

# End-of-turn / end-of-text tokens that stop generation when the vocabulary has them.
KNOWN_STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>")

_PROBE_USER = {"role": "user", "content": "Hi"}
_PROBE_REPLY = "Hello"
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


@dataclass(frozen=True)
class TokenizedChat:
    """Token ids (int32) and the role of each token (int8 ``Role`` values), same length."""

    ids: np.ndarray
    roles: np.ndarray

    def __post_init__(self) -> None:
        if self.ids.shape != self.roles.shape or self.ids.ndim != 1:
            raise ValueError(f"ids {self.ids.shape} and roles {self.roles.shape} must be equal 1-D shapes")

    @classmethod
    def from_lists(cls, ids: Sequence[int], roles: Sequence[int]) -> TokenizedChat:
        return cls(np.asarray(ids, dtype=np.int32).reshape(-1), np.asarray(roles, dtype=np.int8).reshape(-1))

    @classmethod
    def empty(cls) -> TokenizedChat:
        return cls.from_lists([], [])

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __add__(self, other: TokenizedChat) -> TokenizedChat:
        return TokenizedChat(np.concatenate([self.ids, other.ids]), np.concatenate([self.roles, other.roles]))

    def __getitem__(self, index: slice) -> TokenizedChat:
        return TokenizedChat(self.ids[index], self.roles[index])

    @property
    def assistant_content_mask(self) -> np.ndarray:
        """int32 mask, 1 on assistant content tokens and the end-of-turn token the assistant emitted."""
        return (self.roles == Role.ASSISTANT).astype(np.int32)


def _validate_messages(messages: Sequence[Message]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise TokenizerError(f"message {index} must be a dict with 'role' and 'content' keys, got {message!r}")
        if message["role"] not in ROLE_BY_NAME:
            raise TokenizerError(
                f"message {index} has role {message['role']!r}; use one of {sorted(ROLE_BY_NAME)}"
            )
        if not isinstance(message["content"], str):
            raise TokenizerError(
                f"message {index} content must be a string, got {type(message['content']).__name__}"
            )


class ChatTokenizer:
    """A Hugging Face tokenizer with a chat template, rendering conversations to ids and role masks."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None, extra_stop_token_ids: Sequence[int] = (),
                 template_kwargs: Mapping[str, Any] | None = None):
        """Wrap ``tokenizer``; ``chat_template`` overrides the tokenizer's own template.

        Raises:
          TokenizerError: no chat template, a tokenizer without offset mappings (slow tokenizer), or a
            template whose generation prompt / end of turn cannot be separated from message contents.
        """
        self.tokenizer = tokenizer
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: use the default one
            template = template.get("default")
        if not template:
            raise TokenizerError(
                "the tokenizer has no chat template; add a 'chat_template' entry to tokenizer_config.json "
                "(or a chat_template.jinja file) in the model directory, or pass chat_template=... to ChatTokenizer"
            )
        self.chat_template: str = template
        if not getattr(tokenizer, "is_fast", True):
            raise TokenizerError(
                f"{type(tokenizer).__name__} is a slow tokenizer without offset mappings; load it with "
                "AutoTokenizer.from_pretrained(path) (fast tokenizers, also converted from tokenizer.model)"
            )
        self._extra_stop_ids = tuple(int(i) for i in extra_stop_token_ids)
        self.template_kwargs = dict(template_kwargs or {})
        self._probe_turn_boundaries()
        self.rewrites_history = self._probe_history_rewriting()

    @classmethod
    def from_pretrained(cls, path: str | Path, chat_template: str | None = None,
                        template_kwargs: Mapping[str, Any] | None = None) -> ChatTokenizer:
        """Load the tokenizer of a local Hugging Face directory (also reads its generation_config.json stops)."""
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise TokenizerError(f"tokenizer directory {path} does not exist; pass a local Hugging Face model directory")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as err:
            raise TokenizerError(
                f"cannot load a tokenizer from {path} ({err}); the directory needs tokenizer.json or tokenizer.model "
                "plus tokenizer_config.json"
            ) from err
        extra: list[int] = []
        generation_config = path / "generation_config.json"
        if generation_config.is_file():
            try:
                eos = json.loads(generation_config.read_text()).get("eos_token_id")
            except json.JSONDecodeError as err:
                raise TokenizerError(f"{generation_config} is not valid JSON ({err}); fix or remove it") from err
            extra = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(tokenizer, chat_template=chat_template, extra_stop_token_ids=extra, template_kwargs=template_kwargs)

    # ----- text level -------------------------------------------------------------------------------

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The chat template's text for ``messages``."""
        _validate_messages(messages)
        return self._apply_template(messages, add_generation_prompt)

    def _apply_template(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(
                [dict(message) for message in messages],
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except TemplateError as err:
            raise TokenizerError(f"the chat template rejected the conversation: {err}") from err
        if not isinstance(text, str):
            raise TokenizerError(f"apply_chat_template returned {type(text).__name__}, expected text")
        return text

    def _content_spans(self, messages: Sequence[Message], text: str, add_generation_prompt: bool) -> list[tuple[int, int]]:
        """Character span of each message's content inside ``text`` (the rendered conversation)."""
        marked = [{**message, "content": f"\ue000{index}\ue001"} for index, message in enumerate(messages)]
        skeleton = self._apply_template(marked, add_generation_prompt)
        pieces = _PLACEHOLDER.split(skeleton)  # glue, index, glue, index, ..., glue
        glues, order = pieces[0::2], [int(i) for i in pieces[1::2]]
        if order != list(range(len(messages))):
            raise TokenizerError(
                "the chat template drops, repeats or reorders message contents "
                f"(content order in the rendered text: {order}); it cannot be used for token-level role masks"
            )
        spans: list[tuple[int, int]] = []
        cursor = 0
        for index, message in enumerate(messages):
            if not text.startswith(glues[index], cursor):
                raise TokenizerError(f"the chat template renders message {index} inconsistently; cannot align it")
            cursor += len(glues[index])
            content = message["content"]
            next_glue = glues[index + 1]
            for candidate in dict.fromkeys((content, content.strip())):  # templates such as Llama-3 trim contents
                if text.startswith(candidate, cursor) and text.startswith(next_glue, cursor + len(candidate)):
                    spans.append((cursor, cursor + len(candidate)))
                    cursor += len(candidate)
                    break
            else:
                raise TokenizerError(
                    f"the chat template changes the content of message {index} beyond trimming whitespace; "
                    "token roles cannot be aligned with it"
                )
        if text[cursor:] != glues[-1]:
            raise TokenizerError("the chat template's rendered text does not match its structure; cannot align roles")
        return spans

    # ----- token level ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no BOS/EOS added (special-token strings in it are parsed)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_in_turn(self, text: str) -> list[int]:
        """Ids of ``text`` as it tokenizes right after the generation prompt, i.e. as assistant content.

        Differs from ``encode`` for sentencepiece-style tokenizers, which prepend a word-boundary marker
        to the start of a standalone string but not to text that follows the template's glue.
        """
        ids = self.encode(self.generation_prompt_text + text)
        n = len(self.generation_prompt_ids)
        if tuple(ids[:n]) != self.generation_prompt_ids:
            raise TokenizerError(f"text {text[:40]!r} merges with the generation prompt when tokenized")
        return ids[n:]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_assistant(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text an environment should see for sampled assistant ids: stop tokens and specials removed."""
        ids = [int(i) for i in ids]
        stops = set(self.stop_token_ids)
        while ids and ids[-1] in stops:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> TokenizedChat:
        """Ids and roles of the whole conversation (ids equal ``apply_chat_template(..., tokenize=True)``, except
        for templates that rewrite history, whose conversations are rendered turn by turn: module docstring)."""
        if self.rewrites_history and any(m.get("role") == "assistant" for m in messages):
            return self._render_incrementally(messages, add_generation_prompt)
        return self._render_template(messages, add_generation_prompt)[0]

    def _render_template(self, messages: Sequence[Message], add_generation_prompt: bool
                         ) -> tuple[TokenizedChat, list[tuple[int, int]], list[tuple[int, int]]]:
        """The template's own rendering: chat, content span of each message, token character offsets."""
        text = self.render_text(messages, add_generation_prompt)
        spans = self._content_spans(messages, text, add_generation_prompt)
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoding["input_ids"])
        offsets = encoding["offset_mapping"]
        roles = [int(Role.GLUE)] * len(ids)
        stops = set(self.stop_token_ids)
        position = 0
        for index, (span_start, span_end) in enumerate(spans):
            role = int(ROLE_BY_NAME[messages[index]["role"]])

            def inside(token: int) -> bool:
                start, end = offsets[token]
                return (start < span_end and end > span_start) or (start == end and span_start <= start < span_end)

            while position < len(ids) and offsets[position][1] <= span_start and not inside(position):
                position += 1
            while position < len(ids) and offsets[position][0] < span_end:
                if inside(position):
                    roles[position] = role
                position += 1
            if role == Role.ASSISTANT and position < len(ids) and ids[position] in stops:
                roles[position] = role  # the end-of-turn token the assistant emits after its content
        return TokenizedChat.from_lists(ids, roles), spans, [tuple(o) for o in offsets]

    def _render_incrementally(self, messages: Sequence[Message], add_generation_prompt: bool) -> TokenizedChat:
        """A conversation as sampled turn by turn: assistant contents verbatim, other messages appended."""
        _validate_messages(messages)
        chat, history = TokenizedChat.empty(), []
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                if not history or history[-1]["role"] == "assistant":
                    raise TokenizerError("an assistant message must follow a non-assistant message")
                ended = [self.end_of_turn_id] if self.end_of_turn_id is not None else []  # emitted by the model
                chat = chat + self.assistant_turn(self.encode_in_turn(message["content"]) + ended,
                                                  include_generation_prompt=False)
            else:
                follows = messages[index + 1]["role"] == "assistant" if index + 1 < len(messages) else None
                prompt = add_generation_prompt if follows is None else follows
                chat = chat + self.render_turn(history, message, add_generation_prompt=prompt)
            history.append(message)
        return chat

    def render_turn(
        self, history: Sequence[Message], message: Message, add_generation_prompt: bool = False
    ) -> TokenizedChat:
        """Ids and roles of ``message`` (plus the generation prompt if asked) to append to ``render(history)``.

        Raises:
          TokenizerError: when ``render(history)`` is not a prefix of ``render(history + [message])`` and the
            template is not one that only rewrites earlier assistant turns.
        """
        if not history:
            return self.render([message], add_generation_prompt)
        if self.rewrites_history and history[-1]["role"] == "assistant":
            return self._suffix_after_assistant(history, message, add_generation_prompt)
        full = self._render_template([*history, message], add_generation_prompt)[0]
        previous = self._render_template(history, add_generation_prompt=False)[0]
        n = len(previous)
        if len(full) < n or not np.array_equal(full.ids[:n], previous.ids) or not np.array_equal(
            full.roles[:n], previous.roles
        ):
            raise TokenizerError(
                "the chat template is not prefix-consistent: adding a turn changes the tokens of earlier turns "
                f"(first {n} tokens differ). Use a template that renders each turn independently of later ones."
            )
        return full[n:]

    def _suffix_after_assistant(self, history: Sequence[Message], message: Message,
                                add_generation_prompt: bool) -> TokenizedChat:
        """What the template writes after the last assistant turn's end for ``message`` (history-rewriting
        templates): rendered after a history whose assistant contents are their visible parts (no think block)."""
        plain = [{**m, "content": m["content"].rsplit("</think>", 1)[-1].lstrip("\n")} if m["role"] == "assistant"
                 else m for m in history]
        chat, spans, offsets = self._render_template([*plain, message], add_generation_prompt)
        cut = spans[len(plain) - 1][1] + len(self.assistant_end_text)
        starts = [start for start, _ in offsets]
        if cut not in starts:
            raise TokenizerError("the chat template's end of an assistant turn merges with the next turn's tokens; "
                                 "turns cannot be appended as ids")
        return chat[starts.index(cut):]

    def _probe_history_rewriting(self) -> bool:
        """Whether adding a query after an assistant turn changes how that turn renders (Qwen3's think blocks)."""
        user_only = self._apply_template([_PROBE_USER], False)
        for content in (_PROBE_REPLY, f"<think>\n{_PROBE_REPLY}\n</think>\n\n{_PROBE_REPLY}"):
            reply = {"role": "assistant", "content": content}
            before = self._apply_template([_PROBE_USER, reply], False)
            after = self._apply_template([_PROBE_USER, reply, _PROBE_USER], False)
            if after.startswith(before) or not after.startswith(user_only):
                continue  # append-only, or it rewrites more than the assistant turn (render_turn refuses it)
            if not self.assistant_end_text or self.assistant_end_text not in before:
                raise TokenizerError("the chat template rewrites earlier turns and has no recognisable end of turn; "
                                     "it cannot be used for multi-turn rollouts")
            return True
        return False

    # ----- sampler protocol -------------------------------------------------------------------------

    def _probe_turn_boundaries(self) -> None:
        """Find the generation prompt and the assistant end-of-turn in token form; check they are separable."""
        user_text = self._apply_template([_PROBE_USER], False)
        prompt_text = self._apply_template([_PROBE_USER], True)
        if not prompt_text.startswith(user_text) or len(prompt_text) == len(user_text):
            raise TokenizerError(
                "the chat template has no add_generation_prompt block appending to the conversation; a sampler "
                "cannot start an assistant turn with it"
            )
        # A reply as the model would write it: plain, or (thinking templates such as Qwen3's) with a think block.
        for reply in (_PROBE_REPLY, f"<think>\n{_PROBE_REPLY}\n</think>\n\n{_PROBE_REPLY}"):
            replied_text = self._apply_template([_PROBE_USER, {"role": "assistant", "content": reply}], False)
            if replied_text.startswith(prompt_text + reply):
                break
        else:
            raise TokenizerError(
                "the chat template does not render an assistant message as generation prompt + content + end of "
                "turn; sampled assistant ids could not be kept verbatim with it"
            )
        self.generation_prompt_text = prompt_text[len(user_text):]
        self.assistant_end_text = replied_text[len(prompt_text) + len(reply):]
        self.generation_prompt_ids = tuple(self.encode(self.generation_prompt_text))
        self.assistant_end_ids = tuple(self.encode(self.assistant_end_text))
        user_ids, prompt_ids, replied_ids = (self.encode(t) for t in (user_text, prompt_text, replied_text))
        end = list(self.assistant_end_ids)
        if (
            prompt_ids != user_ids + list(self.generation_prompt_ids)
            or replied_ids[: len(prompt_ids)] != prompt_ids
            or (end and replied_ids[-len(end):] != end)
        ):
            raise TokenizerError(
                "this tokenizer merges tokens across the chat template's turn boundaries (generation prompt or "
                "end of turn), so a sampled assistant turn cannot be spliced between them as ids"
            )
        vocab = self.tokenizer.get_vocab()
        stops: list[int] = []
        for candidate in (
            getattr(self.tokenizer, "eos_token_id", None),
            *self._extra_stop_ids,
            *(vocab.get(token) for token in KNOWN_STOP_TOKENS),
        ):
            if candidate is not None and int(candidate) not in stops:
                stops.append(int(candidate))
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        self.end_of_turn_id: int | None = (
            self.assistant_end_ids[0] if self.assistant_end_ids and self.assistant_end_ids[0] in stops else None
        )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Text forms of the stop tokens (for samplers that match strings)."""
        return tuple(self.tokenizer.convert_ids_to_tokens(list(self.stop_token_ids)))

    def stop_sequences(self, texts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Token sequences that end a turn when sampled: each text as encoded alone and after a space (the two
        ways a model usually writes it). Another split of the same characters is not caught."""
        sequences: dict[tuple[int, ...], None] = {}
        for text in texts:
            if not text:
                raise TokenizerError("an empty stop string would end every turn at once; remove it")
            for variant in (text, " " + text):
                sequences[tuple(int(i) for i in self.tokenizer.encode(variant, add_special_tokens=False))] = None
        return tuple(sequences)

    def newline_token_ids(self) -> tuple[int, ...]:
        """Ids of every ordinary token whose text contains a line break (stop ids that end a turn at its first
        line; special tokens excluded)."""
        special = set(self.tokenizer.all_special_ids)
        vocab_size = len(self.tokenizer)
        texts = self.tokenizer.batch_decode([[i] for i in range(vocab_size)])
        return tuple(i for i, text in enumerate(texts) if "\n" in text and i not in special)

    @property
    def pad_token_id(self) -> int:
        """The pad id (the tokenizer's pad token, else its eos)."""
        pad = getattr(self.tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else getattr(self.tokenizer, "eos_token_id", None)
        if pad is None:
            raise TokenizerError("the tokenizer defines neither a pad nor an eos token; set pad_token in tokenizer_config.json")
        return int(pad)

    def generation_prompt(self) -> TokenizedChat:
        """The glue that opens an assistant turn (e.g. ``<|im_start|>assistant\\n``), all ``Role.GLUE``."""
        return TokenizedChat.from_lists(self.generation_prompt_ids, [Role.GLUE] * len(self.generation_prompt_ids))

    def assistant_turn(self, sampled_ids: Sequence[int] | np.ndarray, include_generation_prompt: bool = True) -> TokenizedChat:
        """An assistant turn from sampled ids, kept verbatim (``Role.ASSISTANT``), closed with the end of turn.

        If the sample ends with the end-of-turn token (``<|im_end|>``) only the rest of the end-of-turn glue is
        appended. Otherwise (cut by a length limit, or stopped by another stop token) the whole end of turn is
        appended as ``Role.GLUE``: the model did not produce it, so it is not trained on.
        """
        sampled = [int(i) for i in sampled_ids]
        ids = list(self.generation_prompt_ids) if include_generation_prompt else []
        roles = [int(Role.GLUE)] * len(ids)
        ids += sampled
        roles += [int(Role.ASSISTANT)] * len(sampled)
        end = list(self.assistant_end_ids)
        if self.end_of_turn_id is not None and sampled and sampled[-1] == self.end_of_turn_id:
            end = end[1:]
        ids += end
        roles += [int(Role.GLUE)] * len(end)
        return TokenizedChat.from_lists(ids, roles)
