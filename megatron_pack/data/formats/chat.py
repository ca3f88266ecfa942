"""Chat records as users have them, normalised to one list of ``{"role", "content"}`` messages.

Three shapes reach the tokenizers, all turned into ``(messages, first_trained)``: the
conversation and the index of the first message whose assistant turns are trained.

* chat (``data.messages_key``): ``{"messages": [{"role": "user", "content": "hi"}, ...]}``;
  every assistant turn is trained (``first_trained = 0``).
* ShareGPT, by configuration or ``data.format=sharegpt``: ``{"conversations": [{"from":
  "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}`` with ``data.role_key=from``,
  ``data.content_key=value`` and the aliases ``human -> user``, ``gpt -> assistant``.
* TRL conversational prompt/completion: ``{"prompt": [messages], "completion": [messages]}``;
  only assistant turns of the completion are trained (``first_trained = len(prompt)``), so a
  few-shot assistant turn inside the prompt is context, as in TRL.

Content may be a string or a list of parts ``[{"type": "text", "text": "..."}]`` (OpenAI /
TRL style); text parts are joined, any other part type is refused naming its index and type.
Roles are checked after the aliases: an optional system message, then user and assistant
alternating, tool only after assistant. A user, assistant or tool turn without text (no content,
null or "") is refused.
An assistant turn with ``"weight": 0`` (ShareGPT / Axolotl) stays in the context but carries no
loss; ``weight`` is 0 or 1 (default 1).

Every refusal is a ``RecordError`` with a ``reason`` (``BAD_RECORD_REASONS``), which
``data.on_bad_record=skip`` counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_pack.config.choices import CHAT_ROLES

ROLES = CHAT_ROLES

SHAREGPT = {"messages_key": "conversations", "role_key": "from", "content_key": "value",
            "role_aliases": (("human", "user"), ("gpt", "assistant"), ("function_call", "assistant"),
                             ("observation", "tool"))}
"""The ``data.format=sharegpt`` preset (LLaMA-Factory / Axolotl ShareGPT files)."""

_DEFAULT_KEYS = {"messages_key": "messages", "role_key": "role", "content_key": "content"}


BAD_RECORD_REASONS = ("malformed_json", "not_utf8", "not_an_object", "empty_conversation", "turn_without_content",
                      "unknown_role", "wrong_role_order", "missing_key", "wrong_type", "non_text_part", "empty_sample",
                      "bad_weight", "template_refused", "invalid_unicode", "image_missing", "image_unreadable",
                      "image_mode", "image_count_mismatch")
"""Why a record is bad (``data.on_bad_record=skip`` counts each); docs/data.md lists them."""


class RecordError(ValueError):
    """A record that cannot be tokenized; ``str`` names what is wrong (the caller adds file and line) and
    ``reason`` is one of ``BAD_RECORD_REASONS``. ``fatal`` marks a problem of the configuration, not of
    the record (no chat template at all): it stops ``prepare`` whatever ``data.on_bad_record`` says."""

    def __init__(self, message: str, reason: str = "wrong_type", *, fatal: bool = False):
        super().__init__(message)
        self.reason, self.fatal = reason, fatal


@dataclass(frozen=True)
class SampleSchema:
    """How to read one record: which layout and which keys."""

    kind: str
    """'prompt_completion', 'chat', or 'auto' (per record: 'chat' when it has the messages key)."""
    prompt_key: str = "prompt"
    """Prompt column (prompt_completion; a list of messages makes it TRL conversational)."""
    completion_key: str = "completion"
    """Completion column (prompt_completion)."""
    messages_key: str = "messages"
    """Messages column (chat): a list of {role, content}."""
    role_key: str = "role"
    """Role field of each message."""
    content_key: str = "content"
    """Content field of each message: a string or a list of {type: text, text} parts."""
    role_aliases: tuple[tuple[str, str], ...] = field(default=())
    """(name in the data, role) pairs, e.g. (("human", "user"), ("gpt", "assistant"))."""
    images_key: str = "images"
    """Column listing a record's images (ShareGPT ``<image>`` placeholders, TRL image parts without a path)."""

    def identity(self) -> dict:
        """What the token store's fingerprint hashes; keys at their defaults are left out, so stores
        prepared before the key mapping existed keep their fingerprint."""
        out = {"kind": self.kind, "prompt_key": self.prompt_key, "completion_key": self.completion_key,
               "messages_key": self.messages_key}
        if self.role_key != "role" or self.content_key != "content" or self.role_aliases:
            out.update(role_key=self.role_key, content_key=self.content_key,
                       role_aliases=[list(p) for p in self.role_aliases])
        if self.images_key != "images":
            out["images_key"] = self.images_key
        return out


def schema_from_config(data: Any) -> SampleSchema:
    """The ``SampleSchema`` of a ``DataConfig``; ``format=sharegpt`` fills the keys left at their defaults."""
    keys = {"messages_key": data.messages_key, "role_key": data.role_key, "content_key": data.content_key}
    aliases: dict[str, str] = {}
    if data.format == "sharegpt":
        for name, default in _DEFAULT_KEYS.items():
            if keys[name] == default:
                keys[name] = SHAREGPT[name]
        aliases.update(SHAREGPT["role_aliases"])
    aliases.update(data.role_aliases or {})
    return SampleSchema(data.schema, prompt_key=data.prompt_key, completion_key=data.completion_key,
                        role_aliases=tuple(sorted(aliases.items())), images_key=getattr(data, "images_key", "images"),
                        **keys)


def record_kind(record: dict, schema: SampleSchema) -> str:
    """'chat', 'conversational' (TRL prompt/completion as message lists) or 'prompt_completion'."""
    kind = schema.kind
    if kind == "auto":
        if schema.messages_key in record:
            return "chat"
        if schema.prompt_key not in record and schema.completion_key not in record:
            raise RecordError(f"record has keys {sorted(record)}: neither {schema.messages_key!r} (chat) nor "
                              f"{schema.prompt_key!r}+{schema.completion_key!r}; set data.schema and "
                              "data.prompt_key / data.completion_key / data.messages_key (or data.format=sharegpt)",
                              "missing_key")
        kind = "prompt_completion"
    if kind == "prompt_completion" and isinstance(record.get(schema.prompt_key), list):
        return "conversational"
    return kind


def chat_messages(record: dict, schema: SampleSchema) -> tuple[list[dict], int]:
    """``(messages, first_trained)`` of a chat or TRL conversational record, normalised and checked.
    Messages are ``{role, content}``; a ``weight: 0`` assistant turn (see ``untrained_turns``) also
    carries ``"weight": 0``."""
    if record_kind(record, schema) == "conversational":
        prompt = _message_list(record, schema.prompt_key, schema, allow_empty=True)
        completion = _message_list(record, schema.completion_key, schema, allow_empty=False)
        messages, first_trained, where = prompt + completion, len(prompt), f"{schema.prompt_key}+{schema.completion_key}"
    else:
        messages, first_trained, where = _message_list(record, schema.messages_key, schema), 0, schema.messages_key
    _check_role_order(messages, where)
    return messages, first_trained


def untrained_turns(messages: list[dict]) -> list[int]:
    """Indices of the assistant turns with ``weight: 0`` (context only, no loss)."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1) == 0]


def drop_untrained_turns(mask: list[int], messages: list[dict], first_trained: int = 0) -> list[int]:
    """``mask`` (a template's assistant mask, one run of 1s per trained assistant turn, in order) with the
    runs of the ``weight: 0`` turns set to 0. A mask whose runs cannot be matched to the turns is refused.

    Example: turns user, assistant (weight 0), user, assistant; mask ``[0, 1, 1, 0, 0, 1]`` -> ``[0, 0, 0, 0, 0, 1]``.
    """
    untrained = set(untrained_turns(messages))
    if not untrained:
        return mask
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained]
    starts = [j for j, v in enumerate(mask) if v and (j == 0 or not mask[j - 1])]
    ends = [j + 1 for j, v in enumerate(mask) if v and (j + 1 == len(mask) or not mask[j + 1])]
    if len(starts) != len(turns):
        raise RecordError(f"the chat template's assistant mask has {len(starts)} spans for {len(turns)} assistant "
                          "turns, so the weight: 0 turns cannot be found; drop the weights or use a template that "
                          "renders every assistant turn apart", "template_refused")
    out = list(mask)
    for start, end, turn in zip(starts, ends, turns):
        if turn in untrained:
            out[start:end] = [0] * (end - start)
    return out


def plain_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates take them (``{role, content}`` and an assistant's ``thinking``, no weights)."""
    return [{"role": m["role"], "content": m["content"], **({THINKING_KEY: m[THINKING_KEY]} if THINKING_KEY in m else {})}
            for m in messages]


def _message_list(record: dict, key: str, schema: SampleSchema, allow_empty: bool = False) -> list[dict]:
    if key not in record:
        raise RecordError(f"missing key {key!r} (keys present: {sorted(record)}); set data.messages_key "
                          "(or data.format=sharegpt for ShareGPT 'conversations')", "empty_conversation")
    messages = record[key]
    if not isinstance(messages, list) or (not messages and not allow_empty):
        raise RecordError(f"key {key!r} must be a non-empty list of {{role, content}}, got {type(messages).__name__} "
                          f"({messages!r:.40}); write the conversation as a list of messages or remove the record",
                          "empty_conversation")
    aliases = dict(schema.role_aliases)
    return [_message(m, f"{key}[{i}]", schema, aliases) for i, m in enumerate(messages)]


WEIGHT_KEY = "weight"
"""A message's loss weight (ShareGPT / Axolotl): 0 keeps an assistant turn as context only."""
THINKING_KEY = "thinking"
"""An assistant turn's reasoning, passed to the chat template as the message's ``thinking`` field (transformers'
name: gpt-oss's harmony template renders it in the ``analysis`` channel); docs/data.md says which tokens carry loss."""


def _message(message: Any, where: str, schema: SampleSchema, aliases: dict[str, str]) -> dict:
    rk, ck = schema.role_key, schema.content_key
    if not isinstance(message, dict):
        raise RecordError(f"{where} must be a dict with a {ck!r} (string or text parts), got {message!r:.80}; write "
                          f"each message as {{{rk!r}: ..., {ck!r}: \"text\"}} or set data.role_key / data.content_key")
    raw_role = message.get(rk)
    role = aliases.get(raw_role, raw_role)
    if role not in ROLES:
        hint = ("map it with data.role_aliases={" + f"{raw_role}: user" + "} or data.format=sharegpt"
                if isinstance(raw_role, str) else f"set data.role_key (messages have keys {sorted(message)})")
        raise RecordError(f"{where}.{rk} ({raw_role!r}) must be one of {list(ROLES)}; {hint}, or rename the role "
                          "in the data", "unknown_role")
    content = _content(message[ck], f"{where}.{ck}") if message.get(ck) is not None else None
    if role != "system" and not content:  # a turn of nothing: nothing to read or learn
        shown = "no" if content is None else "an empty"
        raise RecordError(f"{where} ({role}) has no content ({shown} {ck!r}); fill it in or remove the record "
                          f"(set data.content_key if the text is under another key; messages have keys "
                          f"{sorted(message)})", "turn_without_content")
    out = {"role": role, "content": content or ""}
    weight = message.get(WEIGHT_KEY, 1)
    if isinstance(weight, bool) or weight not in (0, 1):
        raise RecordError(f"{where}.{WEIGHT_KEY} ({weight!r}) must be 0 or 1 (0: the turn is context, no loss); "
                          "fix the record", "bad_weight")
    if weight == 0 and role == "assistant":
        out[WEIGHT_KEY] = 0
    thinking = message.get(THINKING_KEY)
    if thinking is not None:
        if role != "assistant" or not isinstance(thinking, str):
            raise RecordError(f"{where}.{THINKING_KEY} ({thinking!r:.40}) must be a string on an assistant turn (its "
                              "reasoning, which gpt-oss's template renders in the analysis channel); move it to the "
                              "assistant turn or remove it", "wrong_type")
        out[THINKING_KEY] = thinking
    return out


IMAGE_PART_KEY = "image_index"
"""Key of the image parts ``formats.images.stage_images`` leaves in a record whose folder has an image processor."""


def _content(content: Any, where: str) -> str | list[dict]:
    """A string, or the text of a list of ``{type: text, text}`` parts joined; with staged image parts
    (``{"type": "image", "image_index": k}``) the parts themselves, for the chat template to render."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RecordError(f"{where} must hold a string 'content' or a list of {{type: text, text}} parts, got "
                          f"{type(content).__name__} ({content!r:.40}); store the message text there", "wrong_type")
    if any(isinstance(p, dict) and IMAGE_PART_KEY in p for p in content):
        return [p if IMAGE_PART_KEY in p else {"type": "text", "text": _content([p], f"{where}[{j}]")}
                for j, p in enumerate(content)]
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            raise RecordError(f"{where}[{j}] is a 'image' part, but data.tokenizer has no image processor "
                              "(preprocessor_config.json, or processor_config.json's image_processor); set "
                              "data.tokenizer to a vision-language model folder (Qwen2.5-VL, Qwen3-VL, Qwen3.5) or "
                              "remove the image", "non_text_part")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RecordError(f"{where}[{j}] is a {kind or type(part).__name__!r} part; only text parts "
                              "({\"type\": \"text\", \"text\": \"...\"}) can be trained on: remove the non-text part or "
                              "the record", "non_text_part")
        texts.append(part["text"])
    return "".join(texts)


_ALLOWED_NEXT = {None: ("system", "user"), "system": ("user",), "user": ("assistant",),
                 "assistant": ("user", "tool"), "tool": ("assistant", "tool")}
"""Roles that may follow each role: optional system first, then user/assistant alternating, tool
results only after an assistant turn (the order chat templates accept)."""


def _check_role_order(messages: list[dict], key: str) -> None:
    previous = None
    for i, message in enumerate(messages):
        role = message["role"]
        if role not in _ALLOWED_NEXT[previous]:
            after = f"after {previous!r}" if previous else "as the first message"
            raise RecordError(f"{key}[{i}].role ({role!r}) is out of order {after} (allowed: "
                              f"{list(_ALLOWED_NEXT[previous])}); a chat is an optional system message, then user "
                              "and assistant turns alternating (tool only after assistant): fix the record's order",
                              "wrong_role_order")
        previous = role


def read_chat_template(path: str) -> str:
    """The text of a ``data.chat_template`` file (a Jinja template)."""
    from pathlib import Path

    from megatron_pack.data.formats.sources import DataError

    file = Path(path)
    if not file.is_file():
        raise DataError(f"data.chat_template ({path!r}) is not a file; set it to a Jinja chat-template file "
                         "(e.g. chatml.jinja) or leave it unset to use the tokenizer's own template.")
    text = file.read_text(encoding="utf-8")
    if "messages" not in text:
        raise DataError(f"data.chat_template ({path}) does not look like a chat template (it never reads "
                         "'messages'); point it at a Jinja template that loops over messages.")
    return text
