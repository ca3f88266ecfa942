"""In-batch packing: a right-padded [B, S] micro-batch becomes one THD row at run time.

This is the ``micro_batch_size > 1`` path (``packing.mode=in_batch``) for batches that arrive
right-padded, e.g. from a vision-language collator. Each row's real length comes from
``lengths`` or from a padding mask (``attention_mask``, 1 on real tokens); it is never guessed
from pad ids. Rows keep their own labels (already aligned with their tokens: nothing is shifted
here). Each row is padded to ``pad_to_multiple_of`` with ``pad_token_id`` tokens, label -100 and
loss_mask 0; position ids keep counting through a row's padding. Example, rows of real lengths
3 and 5 (S = 6)::

    pad_to_multiple_of=1: tokens [a0 a1 a2 b0 b1 b2 b3 b4]   cu_seqlens [0, 3, 8]
                          cu_seqlens_padded [0, 3, 8]          max_seqlen 5
    pad_to_multiple_of=4 (CP=2): tokens [a0 a1 a2 p b0 b1 b2 b3 b4 p p p]
                          labels on the p slots -100, loss_mask 0
                          cu_seqlens [0, 3, 8]   cu_seqlens_padded [0, 4, 12]   max_seqlen 8

The result has the keys of a THD batch (``megatron_pack.data.batches.thd.THD_KEYS``), so
``slice_thd_batch`` and ``get_packed_seq_params`` take it unchanged; ``sample_ids`` holds the
indices of the rows kept.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from megatron_pack.config.layout import round_up

IGNORE_INDEX = -100
"""Label written on padding slots of an in-batch pack."""


def _row_lengths(tokens: torch.Tensor, lengths: Any, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """int64 [B] real lengths from ``lengths`` or a right-padded ``attention_mask``."""
    num_rows, row_size = tokens.shape
    if lengths is not None:
        row_lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1).cpu()
    elif attention_mask is not None:
        mask = torch.as_tensor(attention_mask).cpu() != 0
        if mask.shape != tokens.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but tokens has {tuple(tokens.shape)}.")
        row_lengths = mask.sum(dim=1, dtype=torch.int64)
        right_padded = torch.arange(row_size).unsqueeze(0) < row_lengths.unsqueeze(1)
        bad = torch.nonzero((mask != right_padded).any(dim=1)).reshape(-1)
        if bad.numel():
            raise ValueError(f"attention_mask row {int(bad[0])} is not right-padded (a 0 before a 1); "
                             "pack_batch_sequences needs right-padded rows: pass lengths=... instead.")
    else:
        raise ValueError("pack_batch_sequences needs lengths=[...] or attention_mask=...: real lengths are never "
                         "guessed from pad token ids (a pad id can also be a real token).")
    if row_lengths.numel() != num_rows:
        raise ValueError(f"lengths has {row_lengths.numel()} entries for {num_rows} rows.")
    if bool(((row_lengths < 0) | (row_lengths > row_size)).any()):
        raise ValueError(f"lengths {row_lengths.tolist()} must each be in [0, S={row_size}].")
    return row_lengths


def pack_batch_sequences(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                         position_ids: Optional[torch.Tensor], *, pad_token_id: int, pad_to_multiple_of: int = 1,
                         lengths: Any = None, attention_mask: Optional[torch.Tensor] = None,
                         pack_to_multiple_of: int = 1) -> dict:
    """Pack right-padded [B, S] rows into one THD row [1, T] (see the module docstring).

    ``pack_to_multiple_of`` (1 for none, else a multiple of ``pad_to_multiple_of``; an FP8 recipe's
    ``megatron_pack.config.layout.pack_multiple``) rounds T up with a tail sub-sequence of zero real
    length: rows of 3 and 5 with ``pad_to_multiple_of=4, pack_to_multiple_of=16`` give
    cu_seqlens [0, 3, 8, 8], cu_seqlens_padded [0, 4, 12, 16].

    ``position_ids`` may be None (positions 0..L-1 per row). Empty rows (length 0) are skipped
    with a warning; a batch of only empty rows is an error. Returns tokens/labels/position_ids
    int64 [1, T], loss_mask float32 [1, T], cu_seqlens/cu_seqlens_padded int32 [N+1],
    max_seqlen (longest padded row, int), sample_ids (kept row indices, int64 [N]) and the int
    counts num_real_tokens, num_pad_tokens, num_target_tokens.
    """
    if tokens.dim() != 2:
        raise ValueError(f"pack_batch_sequences expects [B, S] tokens, got shape {tuple(tokens.shape)}.")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of ({pad_to_multiple_of}) must be >= 1; use "
                         "megatron_pack.config.layout.pad_multiple(cp, tp, sequence_parallel).")
    if pack_to_multiple_of < 1 or (pack_to_multiple_of > 1 and pack_to_multiple_of % pad_to_multiple_of):
        raise ValueError(f"pack_to_multiple_of ({pack_to_multiple_of}) must be a multiple of pad_to_multiple_of "
                         f"({pad_to_multiple_of}); use megatron_pack.config.layout.pack_multiple.")
    for name, value in (("labels", labels), ("loss_mask", loss_mask), ("position_ids", position_ids)):
        if value is not None and tuple(value.shape) != tuple(tokens.shape):
            raise ValueError(f"{name} has shape {tuple(value.shape)} but tokens has {tuple(tokens.shape)}.")
    row_lengths = _row_lengths(tokens, lengths, attention_mask)
    empty = torch.nonzero(row_lengths == 0).reshape(-1)
    if empty.numel() == row_lengths.numel():
        raise ValueError(f"every row of the [B={tokens.shape[0]}, S={tokens.shape[1]}] batch is empty (lengths "
                         f"{row_lengths.tolist()}); nothing to pack: drop empty samples before batching.")
    if empty.numel():
        warnings.warn(f"pack_batch_sequences: skipping {empty.numel()} empty row(s) {empty.tolist()}.", stacklevel=2)
    rows = torch.nonzero(row_lengths > 0).reshape(-1)
    real = row_lengths[rows]
    padded = round_up(real, pad_to_multiple_of)
    tail = int(round_up(int(padded.sum()), pack_to_multiple_of)) - int(padded.sum())
    source_rows = rows
    if tail:  # one more sub-sequence of zero real length (reads no row)
        real, padded = torch.cat([real, real.new_zeros(1)]), torch.cat([padded, padded.new_full((1,), tail)])
        source_rows = torch.cat([rows, rows.new_zeros(1)])
    zero = torch.zeros(1, dtype=torch.int64)
    cu_real, cu_padded = torch.cat([zero, real.cumsum(0)]), torch.cat([zero, padded.cumsum(0)])
    num_tokens = int(cu_padded[-1])

    # position j of kept row k sits at cu_padded[k] + j; j < real[k] reads tokens[rows[k], j]
    device = tokens.device
    seq_of = torch.repeat_interleave(torch.arange(source_rows.numel()), padded)
    offset = torch.arange(num_tokens) - cu_padded[:-1][seq_of]
    is_real = (offset < real[seq_of]).to(device)
    src = (source_rows[seq_of] * tokens.shape[1] + offset).to(device)[is_real]

    def gather(value: torch.Tensor, fill, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((num_tokens,), fill, dtype=dtype, device=device)
        out[is_real] = value.reshape(-1)[src].to(dtype)
        return out.unsqueeze(0)

    positions = offset.to(device).unsqueeze(0)  # padding keeps counting after the row's last position
    if position_ids is not None:
        positions[0, is_real] = position_ids.reshape(-1)[src].to(torch.int64)
    packed_mask = gather(loss_mask, 0.0, torch.float32)
    num_real = int(cu_real[-1])
    return {
        "tokens": gather(tokens, pad_token_id, torch.int64),
        "labels": gather(labels, IGNORE_INDEX, torch.int64),
        "loss_mask": packed_mask,
        "position_ids": positions,
        "cu_seqlens": cu_real.to(torch.int32),
        "cu_seqlens_padded": cu_padded.to(torch.int32),
        "max_seqlen": int(padded.max()),
        "sample_ids": rows,
        "num_real_tokens": num_real,
        "num_pad_tokens": num_tokens - num_real,
        "num_target_tokens": int((packed_mask != 0).sum()),
    }


def collate_in_batch(samples, *, pad_multiple: int = 1, pad_id: int = 0, pack_multiple: int = 1) -> dict:
    """One micro-batch of samples -> one THD row, packed at collate time (``packing.mode=in_batch``).

    ``samples`` are the token store's dicts ``{"input_ids", "loss_mask", "sample_id"}`` (ids end with
    eos). They become a right-padded [B, S] batch (``tokens = ids[:-1]``, ``labels = ids[1:]``,
    ``loss_mask = answer_mask[1:]``, real lengths ``len(ids) - 1`` passed as ``lengths``, never read
    from pad ids), which ``pack_batch_sequences`` packs with every sub-sequence padded to
    ``pad_multiple`` (the CP/TP rule). ``sample_ids`` are the store ids. Example, samples of 4 and
    6 ids, ``pad_multiple=4``: rows of 3 and 5 tokens -> cu_seqlens [0, 3, 8], cu_seqlens_padded
    [0, 4, 12], T = 12. ``pack_multiple`` pads T with a tail (``pack_batch_sequences``'s
    ``pack_to_multiple_of``): 16 gives cu_seqlens_padded [0, 4, 12, 16].
    """
    rows = [(torch.as_tensor(s["input_ids"], dtype=torch.int64), torch.as_tensor(s["loss_mask"])) for s in samples]
    lengths = torch.tensor([ids.numel() - 1 for ids, _ in rows], dtype=torch.int64)
    if not rows or int(lengths.min()) < 0:
        raise ValueError("collate_in_batch needs at least one sample, each with at least one id (ending with eos).")
    width = max(int(lengths.max()), 1)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.int64)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (ids, mask) in enumerate(rows):
        n = ids.numel() - 1
        tokens[i, :n], labels[i, :n], loss_mask[i, :n] = ids[:-1], ids[1:], mask[1:].to(torch.float32)
    batch = pack_batch_sequences(tokens, labels, loss_mask, None, pad_token_id=pad_id,
                                 pad_to_multiple_of=pad_multiple, lengths=lengths,
                                 pack_to_multiple_of=pack_multiple)
    store_ids = torch.tensor([int(s.get("sample_id", -1)) for s in samples], dtype=torch.int64)
    batch["sample_ids"] = store_ids[batch["sample_ids"]]
    batch["labels"] = torch.where(batch["labels"] == IGNORE_INDEX, pad_id, batch["labels"])  # as collate_thd
    return batch
