"""``packing.algorithm=wrapped``: one token stream cut into rows of exactly the pack size.

The documents (samples, in a seeded order) are laid end to end, each taking its THD length
``n - 1`` rounded up to the pad multiple ``M``, and the stream is cut every ``capacity``
positions. A document that crosses a row end is cut there into pieces: piece ``k + 1`` starts at
piece ``k``'s last id (its last target is the next piece's first input), so no target is
repeated and no target crosses into another document. Every row but the last is full.

``packing.wrapped_attention`` (recorded in the plan metadata) says how a row is attended:

* ``document``: each piece is its own THD sub-sequence; nothing attends across documents, as
  with any other plan (``verify`` checks it).
* ``cross``: the row is one sequence (pretraining style): tokens attend to earlier documents of
  the row. Labels still never cross a document: a document's last position predicts its eos.
  Pieces are laid without alignment padding (``M = 1`` in the stream); the collate pads the row.

Worked example, documents ``[A B EOS]`` and ``[C D E EOS]`` (2 and 3 positions), capacity 4,
``M = 1``, no shuffle: row 0 = doc 0 (tokens ``A B``, labels ``B EOS``) + doc 1 piece 0 (ids
``C D E``: tokens ``C D``, labels ``D E``); row 1 = doc 1 piece 1 (ids ``E EOS``: token ``E``,
label ``EOS``).
"""

from __future__ import annotations

import numpy as np

from megatron_pack.config.layout import round_up


def wrapped_entries(num_ids: np.ndarray, capacity: int, pad_multiple: int = 1, seed: int = 0
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut the stream of documents into rows; vectorised, O(N + rows).

    ``num_ids[i]`` is document ``i``'s id count (>= 2). Returns ``(document, start, num_ids,
    piece, bin_offsets)``, one entry per piece in row order: ``ids[start:start + num_ids]`` of
    ``document`` is the ``piece``-th piece of it; row ``r`` is entries
    ``bin_offsets[r]:bin_offsets[r + 1]``.
    """
    if capacity % pad_multiple:
        raise ValueError(f"pack size ({capacity}) must be a multiple of the pad multiple ({pad_multiple}).")
    num_ids = np.asarray(num_ids, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(num_ids))
    real = num_ids[order] - 1
    if real.size and real.min() < 1:
        raise ValueError("every document needs at least 2 ids (one position) to be wrapped.")
    slots = round_up(real, pad_multiple)
    doc_start = np.zeros(len(real) + 1, dtype=np.int64)
    np.cumsum(slots, out=doc_start[1:])
    total = int(doc_start[-1])
    # cut points: every document start and every row end inside the stream
    cuts = np.concatenate([doc_start[:-1], np.arange(capacity, total, capacity, dtype=np.int64)])
    cuts.sort(kind="stable")  # two sorted runs: timsort merges them in O(n)
    cuts = cuts[np.concatenate([[True], np.diff(cuts) != 0])] if cuts.size else cuts
    doc = np.searchsorted(doc_start, cuts, side="right") - 1
    seg_end = np.minimum(np.append(cuts[1:], total), doc_start[doc] + real[doc])  # real part only
    start = cuts - doc_start[doc]
    keep = seg_end > cuts  # a segment of alignment padding only (cannot happen: see docstring) is dropped
    cuts, doc, start, seg_end = cuts[keep], doc[keep], start[keep], seg_end[keep]
    first_of_doc = np.searchsorted(doc, doc, side="left")
    piece = (np.arange(len(doc)) - first_of_doc).astype(np.int32)
    rows = cuts // capacity
    bin_offsets = np.zeros(int(rows[-1]) + 2 if rows.size else 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=len(bin_offsets) - 1), out=bin_offsets[1:])
    return order[doc].astype(np.int64), start, (seg_end - cuts + 1).astype(np.int32), piece, bin_offsets
