"""``packing.on_overflow=split``: cut an over-long sample into pieces that each fit a pack.

A sample of ``n`` ids has targets ``ids[1:]`` (target ``t`` is predicted at position ``t - 1``).
A piece is a slice ``ids[start:start + num_ids]`` of at most ``max_len + 1`` ids (``max_len``
positions). Piece ``k + 1`` starts ``overlap + 1`` ids before piece ``k`` ends: it repeats
``overlap`` tokens of context, and the targets it shares with piece ``k`` get no loss, so every
target of the sample is trained in exactly one piece. Pieces keep the sample's answer mask.

Worked example, ``n = 10`` ids (targets 1..9), ``max_len = 4``, ``overlap = 1``::

    piece 0: ids[0:5]   targets 1..4           trained 1, 2, 3, 4
    piece 1: ids[3:8]   targets 4..7  (4 masked) trained 5, 6, 7
    piece 2: ids[6:10]  targets 7..9  (7 masked) trained 8, 9

With ``overlap = 0`` piece ``k + 1`` starts at piece ``k``'s last id (its last target becomes
the next piece's first input), so nothing is repeated as a target either.
"""

from __future__ import annotations

import numpy as np


def split_spans(num_ids: int, max_len: int, overlap: int = 0) -> list[tuple[int, int]]:
    """``(start, num_ids)`` of every piece of a sample of ``num_ids`` ids (see the module docstring).

    >>> split_spans(10, 4, 1)
    [(0, 5), (3, 5), (6, 4)]
    """
    if not 0 <= overlap < max_len:
        raise ValueError(f"split overlap ({overlap}) must be in [0, max_len={max_len}); lower "
                         "packing.split_overlap.")
    spans, start = [], 0
    while True:
        take = min(num_ids - start, max_len + 1)
        spans.append((start, take))
        end = start + take
        if end >= num_ids:
            return spans
        start = end - 1 - overlap


def piece_loss_mask(answer_mask: np.ndarray, piece: int, overlap: int) -> np.ndarray:
    """The mask of a piece (aligned with its ids): the answer mask, with the ``overlap`` repeated
    targets of pieces after the first set to 0 (entries ``1 .. overlap``; entry 0 is never a target)."""
    mask = np.array(answer_mask, copy=True)
    if piece > 0 and overlap:
        mask[1:1 + overlap] = 0
    return mask


def split_entries(sample_ids: np.ndarray, offsets: np.ndarray, answer_mask: np.ndarray, max_len: int,
                  overlap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """The pieces of every sample in ``sample_ids`` that still carry a trained answer target.

    Returns ``(sample, start, num_ids, piece, num_pieces_without_answer)``: one entry per piece
    kept. A piece whose own targets (after the overlap mask) hold no answer token is left out
    and counted; every answer target lies in exactly one piece, so each sample keeps >= 1 piece.
    """
    out: list[tuple[int, int, int, int]] = []
    num_empty = 0
    for sample in np.asarray(sample_ids).tolist():
        lo, hi = int(offsets[sample]), int(offsets[sample + 1])
        for k, (start, num) in enumerate(split_spans(hi - lo, max_len, overlap)):
            targets = answer_mask[lo + start + 1 + (overlap if k else 0):lo + start + num]
            if np.any(targets):
                out.append((sample, start, num, k))
            else:
                num_empty += 1
    if not out:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty.astype(np.int32), empty.astype(np.int32), num_empty
    sample, start, num, piece = (np.array(c) for c in zip(*out))
    return (sample.astype(np.int64), start.astype(np.int64), num.astype(np.int32), piece.astype(np.int32),
            num_empty)
