"""Chat templates rendered with Jinja directly, as transformers renders them, without importing transformers.

``render(template, messages, add_generation_prompt, marked, **special_tokens)`` gives the text and the
``{% generation %}`` character spans that ``transformers.utils.chat_template_utils.render_jinja_template``
gives for one conversation with no tools, no documents and no ``continue_final_message`` (what
``apply_chat_template`` passes for a training record): the same sandboxed environment (``trim_blocks``,
``lstrip_blocks``, the ``generation`` tag and ``loopcontrols`` extensions, its ``tojson`` filter and its
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` globals), the same plain-data copy of the
messages and the same aliasing of a message's reasoning fields. Importing transformers costs ``prepare``'s main
process about 0.7 s, most of its fixed cost; tests/unit/test_chat_render.py compares this module with
transformers' renderer (texts and spans) on a table of templates and conversations, and the tokens and masks
``prepare`` writes with ``apply_chat_template``'s.

Adapted from transformers 5 ``utils/chat_template_utils.py`` (Apache License 2.0, the Hugging Face team).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning is passed under (transformers' ``_REASONING_FIELDS``)."""


@lru_cache(maxsize=32)
def compile_template(template: str):
    """The compiled ``jinja2.Template`` of ``template`` in transformers' chat environment (cached, as theirs)."""
    import jinja2
    import jinja2.exceptions
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    major, minor, patch = (int("".join(c for c in part if c.isdigit()) or 0)
                           for part in (jinja2.__version__.split(".") + ["0", "0"])[:3])
    if (major, minor, patch) < (3, 1, 6):  # transformers refuses these too: known sandbox escapes
        raise ImportError(f"chat templates need jinja2>=3.1.6 (installed: {jinja2.__version__}); "
                          "pip install -U jinja2.")

    class AssistantTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._tracking = ContextVar("assistant_tracker", default=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller) -> str:
            rv = caller()
            tracking = self._tracking.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(rv)))
            return rv

        @contextmanager
        def activate_tracker(self, blocks: list, spans: list):
            if self._tracking.get() is not None:
                raise ValueError("AssistantTracker should not be reused before closed")
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def plain_data(value: Any) -> Any:
    """What the template may see: JSON types rebuilt, anything else an inert ``<TypeName>`` placeholder
    (transformers' ``_plain_template_data``; records read from JSONL or Parquet are plain already)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict) or _is_mapping(value):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return plain_data(value.item())
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _is_mapping(value) -> bool:
    from collections.abc import Mapping

    return isinstance(value, Mapping)


def _alias_reasoning(chat: list) -> list:
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(template: str, messages: list[dict], add_generation_prompt: bool = False, marked: bool = False,
           **special_tokens) -> tuple[str, list[tuple[int, int]]]:
    """``(text, generation spans)`` of one conversation (spans only when ``marked``: the template has
    ``{% generation %}`` markers, as ``return_assistant_tokens_mask=True`` asks); Jinja's errors propagate."""
    compiled = compile_template(template)
    kwargs = plain_data(special_tokens)
    chat = plain_data(list(messages))
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    chat = _alias_reasoning(chat)
    if not marked:
        return compiled.render(messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                               **kwargs), []
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    with compiled.environment.activate_tracker(blocks, spans):
        for block in compiled.generate(messages=chat, tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt, **kwargs):
            blocks.append(block)
        text = "".join(blocks)
    return text, list(spans)
