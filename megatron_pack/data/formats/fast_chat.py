"""Chat records in batches: render each conversation without Jinja where the template allows it,
encode a chunk in one Rust call, read the assistant mask from token offsets.

The per-record path calls ``apply_chat_template(messages, return_assistant_tokens_mask=True)``
for every record. That call renders the template (Jinja, with ``{% generation %}`` spans
recorded as character offsets), encodes the text, builds a ``BatchEncoding`` and walks the
tokens in Python. Here the same steps run once per chunk of records:

1. ``ChatRenderer.render`` gives each conversation's text and assistant character spans:
   pasted into the shape's skeleton when the template is a fixed pattern
   (``chat_skeleton.analyse``; the skeleton is rendered once per sequence of roles), else
   rendered as ``render_jinja_template``, transformers' own renderer, renders it with the arguments
   ``apply_chat_template`` passes (``chat_render``, without importing transformers);
2. the fast tokenizer's backend encodes every rendered text in one ``encode_batch`` call
   (``add_special_tokens=False``, no truncation or padding, as ``apply_chat_template`` does);
3. ``assistant_mask`` marks the tokens that overlap a span, vectorised, with exactly the rule of
   transformers' loop (tests compare the masks token by token on every template style).

Example: rendered ``"<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\nyo<|im_end|>\\n"``
with the span of ``"yo<|im_end|>"`` marks the tokens ``yo`` and ``<|im_end|>`` only.

Templates without generation markers get their mask from growing prefixes (``encode_by_prefixes``),
the rule of ``HFTokenizer._prefix_mask`` computed from one encoding of the whole text.
"""

from __future__ import annotations

import re
import weakref
from itertools import chain

import numpy as np

from megatron_pack.data.formats.chat_skeleton import analyse, build_skeleton


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


_MARKER = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' own test for generation markers
_MAX_SHAPES = 4096
"""Skeletons kept per tokenizer; a set with more distinct role sequences renders the rest anew."""


def has_generation_markers(template: str | None) -> bool:
    """Whether a chat template marks assistant turns (``{% generation %}``, transformers' own test)."""
    return bool(template) and bool(_MARKER.search(template))


class ChatRenderer:
    """``render(messages, add_generation_prompt)`` -> ``(text, assistant spans)``, as
    ``render_jinja_template`` gives them for the tokenizer's template and special tokens; by
    skeleton (one Jinja render per role sequence) when ``analyse`` proves the template a fixed
    pattern. A shape whose skeleton cannot be built (the template raises for those roles, or
    cuts a sentinel) is rendered by Jinja, which raises or renders as it always does."""

    def __init__(self, tok):
        self.template = tok.get_chat_template()
        self.kwargs = dict(tok.special_tokens_map)
        self.marked = has_generation_markers(self.template)
        self.shape = analyse(self.template)
        self._skeletons: dict = {}
        self._turn_plans: dict = {}

    def jinja(self, messages: list[dict], add_generation_prompt: bool = False):
        from megatron_pack.data.formats.chat_render import render

        return render(self.template, messages, add_generation_prompt, self.marked, **self.kwargs)

    def skeleton(self, roles: tuple[str, ...], add_generation_prompt: bool = False):
        """The shape's ``Skeleton``, or None (not a fixed pattern, or this shape cannot be cut)."""
        if not self.shape.fixed:
            return None
        key = (roles, add_generation_prompt)
        skeleton = self._skeletons.get(key, False)
        if skeleton is False:
            try:
                skeleton = build_skeleton(self.jinja, roles, add_generation_prompt)
            except Exception:  # Unsupported, or the template raising for these roles: Jinja decides
                skeleton = None
            if len(self._skeletons) < _MAX_SHAPES:
                self._skeletons[key] = skeleton
        return skeleton

    def render(self, messages: list[dict], add_generation_prompt: bool = False):
        skeleton = self.skeleton(tuple(m["role"] for m in messages), add_generation_prompt)
        if skeleton is not None:
            return skeleton.fill([m["content"] for m in messages])
        return self.jinja(messages, add_generation_prompt)

    def render_turns(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]] | None]:
        """The text, and per assistant turn ``i`` the lengths of ``render(messages[:i], True)`` and
        ``render(messages[:i + 1])``, both text prefixes of it (None where one is not)."""
        roles = tuple(m["role"] for m in messages)
        plan = self._turn_plans.get(roles, False)
        if plan is False:
            plan = self._turn_plan(roles)
            if len(self._turn_plans) < _MAX_SHAPES:
                self._turn_plans[roles] = plan
        if plan is not None:
            text, starts = plan[0].layout([m["content"] for m in messages])
            return text, [(starts[a] + x, starts[b] + y) for (a, x), (b, y) in plan[1]]
        text, turns = self.render(messages)[0], []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prefix = self.render(messages[:i], add_generation_prompt=True)[0] if i else ""
                end = self.render(messages[:i + 1])[0]
                if not (text.startswith(end) and end.startswith(prefix)):
                    return text, None
                turns.append((len(prefix), len(end)))
        return text, turns

    def _turn_plan(self, roles: tuple[str, ...]):
        """``(skeleton, [((k, extra) of the prefix, (k, extra) of the end) per assistant turn])``, or None."""
        whole = self.skeleton(roles)
        if whole is None:
            return None
        cuts = []
        for i, role in enumerate(roles):
            if role != "assistant":
                continue
            prefix = self.skeleton(roles[:i], True) if i else None
            end = self.skeleton(roles[:i + 1])
            if (i and prefix is None) or end is None:
                return None
            a = whole.prefix_cut(prefix) if i else (0, 0)
            b = whole.prefix_cut(end)
            if a is None or b is None:
                return None
            cuts.append((a, b))
        return whole, cuts


_RENDERERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def renderer_for(tok) -> ChatRenderer:
    """The tokenizer's ``ChatRenderer``, made once (and again if its chat template changed)."""
    renderer = _RENDERERS.get(tok)
    if renderer is None or renderer.template != tok.get_chat_template():
        renderer = _RENDERERS[tok] = ChatRenderer(tok)
    return renderer


def supports_batched_chat(tok) -> bool:
    """True for a fast tokenizer with a chat template (marked or not)."""
    return getattr(tok, "is_fast", False) and hasattr(tok, "backend_tokenizer") and bool(tok.chat_template)


def _chunk_arrays(encodings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every encoding's ids (int32) and offsets (int64 [n, 2]) in two flat arrays, and the token
    bounds of each (``bounds[i]:bounds[i + 1]``): one conversion per chunk, not per record."""
    lengths = np.fromiter((len(e) for e in encodings), np.int64, len(encodings))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    total = int(bounds[-1])
    ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), np.int32, total)
    offsets = np.fromiter(chain.from_iterable(chain.from_iterable(e.offsets for e in encodings)), np.int64,
                          2 * total).reshape(total, 2)
    return ids, offsets, bounds


def encode_chats(tok, conversations: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids int32, assistant mask uint8)`` of every conversation, as ``apply_chat_template(...,
    return_assistant_tokens_mask=True)`` gives them one at a time (a template with markers).

    The mask of the whole chunk is one ``assistant_mask`` call: record ``r``'s offsets and spans
    are shifted by ``base[r]`` (the lengths of the texts before it, plus one each), so every token
    of ``r`` starts after every span of the records before it and ends before every span after
    it; the rule's span index then passes the earlier spans and never reaches a later one,
    which is the rule on ``r`` alone.
    """
    renderer = renderer_for(tok)
    rendered = [renderer.render(messages) for messages in conversations]
    encodings = _backend(tok).encode_batch([text for text, _ in rendered], add_special_tokens=False)
    ids, offsets, bounds = _chunk_arrays(encodings)
    sizes = np.fromiter((len(text) + 1 for text, _ in rendered), np.int64, len(rendered))
    base = np.cumsum(sizes) - sizes
    offsets = offsets + np.repeat(base, np.diff(bounds))[:, None]
    spans = [(a + int(b), e + int(b)) for (_, record_spans), b in zip(rendered, base) for a, e in record_spans]
    mask = assistant_mask(offsets, spans)
    return [(ids[bounds[i]:bounds[i + 1]], mask[bounds[i]:bounds[i + 1]]) for i in range(len(rendered))]


def split_token_ids(tok) -> frozenset[int]:
    """Added tokens the tokenizer cuts the text at before anything else looks at it: not normalised,
    no stripping of neighbouring spaces, not single-word. Every piece of text between two of them is
    normalised, pre-tokenized and encoded on its own (Hugging Face tokenizers' added vocabulary),
    and only knows whether it starts the text; so the tokens of a prefix that ends at, or starts
    an added token at, such a token are the whole text's tokens up to there."""
    return frozenset(i for i, t in tok.backend_tokenizer.get_added_tokens_decoder().items()
                     if not (t.normalized or t.lstrip or t.rstrip or t.single_word))


def space_cuts(tok) -> bool:
    """True when a space after a non-space is a token boundary the whole text and its prefix
    agree on: a SentencePiece-style BPE (no normaliser; ``Metaspace`` turning spaces into ``▁``
    without splitting, so a segment is one word; BPE without dropout or affixes) whose vocabulary
    has no token with ``▁`` after another character (SentencePiece's ``split_by_whitespace``, as
    Llama 2 and Mistral v0.1). A BPE merge makes a vocabulary token, so none joins ``x`` and a
    following ``▁``: the word's merges on either side of that point never meet, and the prefix
    ending there is encoded into exactly the tokens the whole text has before it."""
    cached = _SPACE_CUTS.get(tok)
    if cached is None:
        from tokenizers import models, pre_tokenizers

        backend = _backend(tok)
        pre, model = backend.pre_tokenizer, backend.model
        cached = (backend.normalizer is None and isinstance(pre, pre_tokenizers.Metaspace) and not pre.split
                  and pre.replacement == "\u2581" and isinstance(model, models.BPE) and model.dropout is None
                  and not model.continuing_subword_prefix and not model.end_of_word_suffix
                  and not any("\u2581" in t[1:] and _space_after_other(t) for t in backend.get_vocab(False)))
        _SPACE_CUTS[tok] = cached
    return cached


def _space_after_other(token: str) -> bool:
    return any(c == "\u2581" and token[i - 1] != "\u2581" for i, c in enumerate(token) if i)


_SPACE_CUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def encode_by_prefixes(tok, conversations: list[list[dict]]) -> list:
    """``(ids, assistant mask)`` by ``HFTokenizer._prefix_mask``'s rule, or None for a conversation
    whose rule this path cannot prove here (the caller runs the per-record rule, which renders or
    refuses it as always).

    The rule: assistant turn ``i`` is tokens ``[len(enc(P)), len(enc(E)))`` where ``P`` renders the
    turns before ``i`` with the generation prompt and ``E`` the turns up to ``i``, both required to
    be token prefixes of the whole conversation's tokens. Here ``P`` and ``E`` must be text prefixes
    of the whole text ``T`` (else None); ``enc(T[:p])`` is ``T``'s tokens before ``p`` when an added
    token of ``split_token_ids`` starts or ends at ``p``, and otherwise ``T``'s tokens before the last
    such token ahead of ``p`` followed by the encoding of the window from that token to ``p`` (one
    more ``encode_batch`` for all windows; a chat turn usually opens with such a token, so a window
    is about one turn). For a SentencePiece-style tokenizer, a space after a non-space is such a
    point too (``space_cuts``).
    """
    renderer, backend = renderer_for(tok), _backend(tok)
    split_ids = np.array(sorted(split_token_ids(tok)), dtype=np.int32)
    spaces = space_cuts(tok)
    texts, cuts = [], []  # cuts: per conversation, (p_start, p_end) per assistant turn, or None
    for messages in conversations:
        text, turns = renderer.render_turns(messages)
        texts.append(text)
        cuts.append(turns)
    all_ids, all_offsets, bounds = _chunk_arrays(backend.encode_batch(texts, add_special_tokens=False))
    plans, windows = [], []
    for i, (text, turns) in enumerate(zip(texts, cuts)):
        ids, offsets = all_ids[bounds[i]:bounds[i + 1]], all_offsets[bounds[i]:bounds[i + 1]]
        plan = None if turns is None else _prefix_plan(text, turns, ids, offsets, split_ids, spaces, windows)
        plans.append((ids, plan))
    window_ids = [list(e.ids) for e in backend.encode_batch(windows, add_special_tokens=False)] \
        if windows else []
    out = []
    for ids, plan in plans:
        out.append(None if plan is None else _prefix_mask_from_plan(ids, plan, window_ids))
    return out


def _prefix_plan(text, turns, ids, offsets, split_ids, spaces, windows):
    """Per turn, how to get ``enc(T[:p])`` for its two cut points: ``("head", k)`` (``ids[:k]``) or
    ``("window", k, w)`` (``ids[:k]`` + window ``w``'s tokens, appended to ``windows``)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    is_split = np.isin(ids, split_ids)
    split_at = np.flatnonzero(is_split)

    def head(p: int):
        if p == 0:
            return ("head", 0)
        if p == len(text):
            return ("head", len(ids))
        j = int(np.searchsorted(starts, p, side="left"))
        if (j < len(ids) and starts[j] == p and is_split[j]) or (j > 0 and ends[j - 1] == p and is_split[j - 1]):
            return ("head", j)
        if spaces and text[p] == " " and text[p - 1] != " " and (j == 0 or ends[j - 1] <= p):
            return ("head", j)
        before = split_at[ends[split_at] <= p]
        k = int(before[-1]) if before.size else 0
        windows.append(text[int(starts[k]) if before.size else 0:p])
        return ("window", k, len(windows) - 1)

    return [(head(a), head(b)) for a, b in turns]


def _prefix_mask_from_plan(ids, plan, window_ids):
    """The mask, or None where a prefix is not a token prefix (the per-record rule then refuses it)."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    ids_list = None
    for start_how, end_how in plan:
        bounds = []
        for how in (start_how, end_how):
            if how[0] == "head":
                bounds.append(how[1])
                continue
            if ids_list is None:
                ids_list = ids.tolist()
            k, w = how[1], how[2]
            prefix = ids_list[:k] + window_ids[w]
            if ids_list[:len(prefix)] != prefix:
                return None
            bounds.append(len(prefix))
        start, end = bounds
        if start > end:
            return None
        mask[start:end] = 1
    return ids, mask
