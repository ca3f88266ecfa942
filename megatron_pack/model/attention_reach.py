"""Sliding windows and attention sinks: what a query at position p of sub-sequence s may read, written once.

The two settings are megatron-core's own (``TransformerConfig.window_size``, ``window_attn_skip_freq`` and
``softmax_type``; which layers are windowed is megatron-core's ``is_layer_window_attention``: with
``window_attn_skip_freq=N`` every N-th layer counted from 1 keeps full attention); the torch THD core (``model/attention.py``) computes them here, Transformer Engine's fused THD
attention receives the same values from megatron-core (``model/te_attention.py`` says which TE can).

**Window.** Positions count from 0 at the first row of each sub-sequence (``cu_seqlens_padded``); under context
parallelism a zigzag chunk's rows keep their global (un-sliced) positions. With ``window_size=(left, right)``
(causal attention: ``right`` is 0; ``left=-1`` means unlimited) the query at position ``p`` reads the key at
position ``j`` of the *same* sub-sequence iff ``max(0, p - left) <= j <= p``. So a window never reaches into the
previous sample, and it is never cut at the pack's start: a sample's first rows read from their own start.
Example, window (2, 0), pack ``[a0 a1 a2 a3 | b0 b1]``: a3 reads a1 a2 a3; b0 reads b0 only (not a2, a3);
b1 reads b0 b1. transformers' ``sliding_window=W`` reads the W most recent keys, the query's own included:
``left = W - 1``.

**Sink.** One extra logit per head in every query's softmax, with no value behind it:
``probs_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k))``. ``softmax_type='vanilla'``: none; ``'off-by-one'``:
``sink_h = 0``; ``'learnable'``: ``sink_h`` is the parameter ``softmax_offset`` [heads] (megatron-core's name, split
over TP with the heads), trained like any other weight. A query with no key left to read (never the case
for causal attention: it reads itself) would give zeros.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from megatron_pack.config.choices import SOFTMAX_TYPES


def window_left(window_size: Optional[Sequence[int]]) -> Optional[int]:
    """How far back a query reads (None: unlimited) for megatron-core's ``window_size`` of a causal layer.

    >>> window_left(None), window_left((-1, 0)), window_left((7, 0))
    (None, None, 7)
    """
    if window_size is None:
        return None
    left, right = (int(v) for v in window_size)
    if right not in (0, -1) or left < -1:
        raise ValueError(f"window_size ({left}, {right}) must be (left >= 0 or -1, 0) for causal attention.")
    return None if left < 0 else left


def first_key(positions: Sequence[int], left: Optional[int]) -> int:
    """The first key position any of ``positions`` reads: the K/V rows before it are never needed.

    >>> first_key([5, 9], 3), first_key([5, 9], None), first_key([1], 3)
    (2, 0, 0)
    """
    return 0 if left is None or not positions else max(0, min(positions) - left)


def reach_mask(positions: Tensor, key_start: int, num_keys: int, left: Optional[int]) -> Tensor:
    """[m, num_keys] bool: query ``positions[i]`` may read the key at position ``key_start + j``.

    >>> reach_mask(torch.tensor([2, 3]), 1, 3, 1).int().tolist()
    [[1, 1, 0], [0, 1, 1]]
    """
    keys = torch.arange(key_start, key_start + num_keys, device=positions.device)[None, :]
    allowed = keys <= positions[:, None]
    if left is not None:
        allowed &= keys >= positions[:, None] - left
    return allowed


def sink_logits(softmax_type: str, softmax_offset: Optional[Tensor], num_heads: int, like: Tensor
                ) -> Optional[Tensor]:
    """The per-head sink logit [heads] of ``softmax_type`` (None for 'vanilla')."""
    if softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"softmax_type {softmax_type!r} must be one of {list(SOFTMAX_TYPES)}.")
    if softmax_type == "vanilla":
        return None
    if softmax_type == "off-by-one":
        return torch.zeros(num_heads, dtype=like.dtype, device=like.device)
    if softmax_offset is None or softmax_offset.numel() != num_heads:
        raise ValueError(f"softmax_type 'learnable' needs softmax_offset with one logit per head ({num_heads}).")
    return softmax_offset


def attend_with_sink(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, sink: Tensor,
                     dropout_p: float = 0.0) -> Tensor:
    """Attention with a sink logit per query head: q [hq, m, d], k/v [hk, n, d], allowed [m, n], sink [hq].

    Scores and softmax run in float32 at least (float64 stays float64), the sink column dropped after the
    softmax; returns [hq, m, d] in q's dtype.
    """
    work = torch.promote_types(q.dtype, torch.float32)
    rep = q.size(0) // k.size(0)
    k_, v_ = k.repeat_interleave(rep, dim=0).to(work), v.repeat_interleave(rep, dim=0).to(work)
    scores = torch.einsum("hmd,hnd->hmn", q.to(work), k_) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    column = sink.to(work)[:, None, None].expand(-1, scores.size(1), 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p)
    return torch.einsum("hmn,hnd->hmd", probs, v_).to(q.dtype)
