"""Chat records tokenized in batches: render the template once per chunk, encode with the fast
tokenizer in one Rust call, read the assistant mask from token offsets.

The per-record path calls ``apply_chat_template(messages, return_assistant_tokens_mask=True)``
for every record. That call renders the template (Jinja, with ``{% generation %}`` spans
recorded as character offsets), encodes the text, builds a ``BatchEncoding`` and walks the
tokens in Python. Here the same three steps run once per chunk of records:

1. ``render_jinja_template`` (transformers' own renderer, with the same arguments
   ``apply_chat_template`` passes) renders every conversation and returns each one's
   assistant character spans;
2. the fast tokenizer's backend encodes every rendered text in one ``encode_batch`` call
   (``add_special_tokens=False``, no truncation or padding, as ``apply_chat_template`` does);
3. ``assistant_mask`` marks the tokens that overlap a span, vectorised, with exactly the rule of
   transformers' loop (tests compare the masks token by token on every template style).

Example: rendered ``"<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\nyo<|im_end|>\\n"``
with the span of ``"yo<|im_end|>"`` marks the tokens ``yo`` and ``<|im_end|>`` only.
"""

from __future__ import annotations

import weakref
from itertools import chain

import numpy as np


def assistant_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [num_tokens]: 1 where a token overlaps an assistant span (transformers' rule).

    transformers walks the tokens in order with a span index that only moves forward past spans
    ending at or before the token's start, and marks a token whose end lies after the current
    span's start. Vectorised: the span index of token ``t`` is the number of span ends ``<=``
    the running maximum of token starts up to ``t``.

    >>> assistant_mask(np.array([[0, 2], [2, 4], [4, 6], [6, 8]]), [(3, 6)]).tolist()
    [0, 1, 1, 0]
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not spans or offsets.size == 0:
        return np.zeros(len(offsets), dtype=np.uint8)
    span_start = np.array([s for s, _ in spans], dtype=np.int64)
    span_end = np.array([e for _, e in spans], dtype=np.int64)
    index = np.searchsorted(span_end, np.maximum.accumulate(offsets[:, 0]), side="right")
    valid = index < len(spans)
    return (valid & (offsets[:, 1] > span_start[np.minimum(index, len(spans) - 1)])).astype(np.uint8)


_PLAIN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Per tokenizer object, its backend copy without truncation and padding (made once, not per chunk)."""


def _backend(tok):
    """The fast tokenizer's backend with truncation and padding off (what ``apply_chat_template`` encodes with)."""
    backend = tok.backend_tokenizer
    if backend.truncation is None and backend.padding is None:
        return backend
    plain = _PLAIN.get(tok)
    if plain is None:
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(backend.to_str())
        plain.no_truncation()
        plain.no_padding()
        _PLAIN[tok] = plain
    return plain


def supports_batched_chat(tok) -> bool:
    """True for a fast tokenizer whose chat template marks assistant turns with ``{% generation %}``."""
    return (getattr(tok, "is_fast", False) and hasattr(tok, "backend_tokenizer")
            and "{% generation %}" in (tok.chat_template or ""))


def encode_chats(tok, conversations: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids int32, assistant mask uint8)`` of every conversation, as ``apply_chat_template(...,
    return_assistant_tokens_mask=True)`` gives them one at a time."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, spans = render_jinja_template(
        conversations=conversations, tools=None, documents=None, chat_template=tok.get_chat_template(),
        return_assistant_tokens_mask=True, continue_final_message=False, add_generation_prompt=False,
        **tok.special_tokens_map)
    encodings = _backend(tok).encode_batch(rendered, add_special_tokens=False)
    out = []
    for enc, span in zip(encodings, spans):
        n = len(enc)
        offsets = np.fromiter(chain.from_iterable(enc.offsets), np.int64, 2 * n)  # 2x faster than via tuples
        out.append((np.fromiter(enc.ids, np.int32, n), assistant_mask(offsets, list(span))))
    return out
