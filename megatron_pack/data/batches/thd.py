"""Collate one pack of tokenized samples into a THD batch (micro-batch size 1).

A sample of ``n`` ids ``x`` (ending with eos) and answer mask ``m`` contributes ``n - 1``
positions: ``tokens = x[:-1]``, ``labels = x[1:]``, ``loss_mask = m[1:]``, ``position_ids =
0..n-2``; no target ever crosses into the next sample. Each sub-sequence is padded to a multiple
of ``pad_multiple`` with ``pad_id`` as both token and label and loss_mask 0; position ids keep
counting through a sub-sequence's own padding. Boundaries come only from sample lengths, never
from token values. The 6-token example, samples ``[A, B, EOS]`` and ``[C, D, EOS]``::

    pad_multiple=1: tokens [A, B, C, D]       labels [B, EOS, D, EOS]  position_ids [0, 1, 0, 1]
                    cu_seqlens [0, 2, 4]       cu_seqlens_padded [0, 2, 4]     max_seqlen 2
    pad_multiple=4: tokens [A, B, p, p, C, D, p, p]   labels [B, EOS, p, p, D, EOS, p, p]
                    loss_mask [1, 1, 0, 0, 1, 1, 0, 0] position_ids [0, 1, 2, 3, 0, 1, 2, 3]
                    cu_seqlens [0, 2, 4]       cu_seqlens_padded [0, 4, 8]     max_seqlen 4

With ``pad_to_max_length`` the batch has exactly ``pack_size`` tokens: the tail after the last
sample is one more sub-sequence of zero real length (``cu_seqlens`` repeats its last value,
``cu_seqlens_padded`` ends at ``pack_size``). Without it, ``pack_multiple`` (an FP8 recipe's rule,
``megatron_pack.config.layout.pack_multiple``) rounds the total up the same way: the 6-token example
with ``pad_multiple=4, pack_multiple=16`` gets a tail of 8, ``cu_seqlens [0, 2, 4, 4]``,
``cu_seqlens_padded [0, 4, 8, 16]``, T = 16. With ``num_cu_seqlens`` (CUDA graphs:
``max_samples_per_bin + 2``) both cu_seqlens arrays have exactly that length, filled by
repeating their last value, and ``max_seqlen`` is a dataset-wide constant.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from megatron_pack.config.layout import round_up

THD_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded", "max_seqlen",
            "sample_ids", "num_real_tokens", "num_pad_tokens", "num_target_tokens")
"""Keys of every THD batch, in order."""


def _read_samples(samples: Sequence[Mapping[str, Any]]) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """ids and masks as numpy arrays plus sample ids (-1 when a sample carries none); checks alignment."""
    if len(samples) == 0:
        raise ValueError("collate_thd got an empty pack (no samples); the packing plan has an empty bin: "
                         "re-run `megatron-pack prepare`.")
    ids, masks, sample_ids = [], [], np.empty(len(samples), dtype=np.int64)
    for i, sample in enumerate(samples):
        x = np.asarray(sample["input_ids"], dtype=np.int64).reshape(-1)
        m = np.asarray(sample["loss_mask"]).reshape(-1)
        sample_ids[i] = int(sample.get("sample_id", -1))
        if x.size < 1 or x.size != m.size:
            raise ValueError(
                f"sample {i} of the pack (sample_id {sample_ids[i]}) has {x.size} input_ids and {m.size} loss_mask "
                "entries; each sample needs >= 1 id (ending with eos) and a loss_mask of the same length: "
                "re-run `megatron-pack prepare`.")
        ids.append(x)
        masks.append(m)
    return ids, masks, sample_ids


def _total(used: int, pack_size: int, pad_to_max_length: bool, pack_multiple: int) -> int:
    """Tokens of the pack: ``pack_size`` with pad_to_max_length, else ``used`` rounded up to ``pack_multiple``."""
    if pack_multiple < 1 or (pack_multiple > 1 and pack_size % pack_multiple):
        raise ValueError(
            f"pack_size ({pack_size}) is not a multiple of the pack multiple ({pack_multiple}), so a padded pack could "
            f"leave some rank a partial FP8 block; set packing.packed_sequence_size to a multiple of {pack_multiple}.")
    return pack_size if pad_to_max_length else round_up(used, pack_multiple)


def _layout(real: np.ndarray, pad_multiple: int, pack_size: int, pad_to_max_length: bool,
             sample_ids: np.ndarray, pack_multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Real and padded lengths of every sub-sequence, the tail (pad_to_max_length or pack_multiple) included."""
    padded = round_up(real, pad_multiple)
    used = int(padded.sum())
    if used > pack_size:
        raise ValueError(
            f"pack with sample_ids {sample_ids.tolist()} needs {used} tokens after padding each sample to a multiple of "
            f"{pad_multiple}, more than pack_size={pack_size}; the plan was made for a smaller pad multiple: re-run "
            f"`megatron-pack prepare` with packing.pad_seq_to_mult={pad_multiple} (or a multiple of it).")
    total = _total(used, pack_size, pad_to_max_length, pack_multiple)
    if used < total:
        tail = total - used
        if tail % pad_multiple:
            raise ValueError(
                f"pack_size ({pack_size}) is not a multiple of the pad multiple ({pad_multiple}), so the padding tail "
                f"({tail} tokens) cannot be split for context parallelism; set packing.packed_sequence_size to a "
                f"multiple of {pad_multiple}.")
        real = np.append(real, 0)
        padded = np.append(padded, tail)
    return real, padded


def _fixed_length(cu: np.ndarray, num_cu_seqlens: Optional[int], sample_ids: np.ndarray) -> np.ndarray:
    """``cu`` extended to ``num_cu_seqlens`` entries by repeating its last value (zero-length sub-sequences)."""
    if num_cu_seqlens is None:
        return cu
    if cu.size > num_cu_seqlens:
        raise ValueError(
            f"pack with sample_ids {sample_ids.tolist()} has {cu.size - 1} sub-sequences but num_cu_seqlens="
            f"{num_cu_seqlens} allows {num_cu_seqlens - 1}; num_cu_seqlens must be max_samples_per_bin + 2 from the "
            "packed dataset's metadata: re-run `megatron-pack prepare` if the metadata is from another plan.")
    return np.concatenate([cu, np.full(num_cu_seqlens - cu.size, cu[-1], dtype=cu.dtype)])


def _cumsum0(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def collate_thd(samples: Sequence[Mapping[str, Any]], *, pack_size: int, pad_multiple: int = 1,
                pad_to_max_length: bool = False, num_cu_seqlens: Optional[int] = None, pad_id: int = 0,
                max_seqlen: Optional[int] = None, pack_multiple: int = 1) -> dict:
    """One pack -> one THD batch (see the module docstring for the layout and a worked example).

    ``samples`` are dicts ``{"input_ids", "loss_mask"[, "sample_id"]}``. Returns the keys of
    ``THD_KEYS``: tokens/labels int64 [1, T], loss_mask float32 [1, T] (0/1), position_ids int64
    [1, T], cu_seqlens/cu_seqlens_padded int32, max_seqlen int, sample_ids int64 (one per real
    sample, in pack order; -1 where a sample has no ``sample_id``; the padding tail and the
    fixed-length fill have none), and the Python-int counts ``num_real_tokens``,
    ``num_pad_tokens`` (T - real) and ``num_target_tokens`` (loss_mask.sum()).

    ``max_seqlen``: None means the longest padded sub-sequence of this pack (tail included);
    with ``num_cu_seqlens`` a None means ``pack_size`` (a dataset-wide constant). A value given
    must be >= every padded length.

    ``pack_multiple`` (1 for none, else a multiple of ``pad_multiple``): without ``pad_to_max_length``
    the pack's token count is rounded up to it by a tail sub-sequence of zero real length, so each
    of the CP (x TP with sequence parallelism) ranks holds whole FP8 blocks (docs/thd.md).
    """
    if pad_multiple < 1 or pack_size < 1:
        raise ValueError(f"collate_thd: pack_size ({pack_size}) and pad_multiple ({pad_multiple}) must be >= 1.")
    if pack_multiple < 1 or (pack_multiple > 1 and pack_multiple % pad_multiple):
        raise ValueError(f"collate_thd: pack_multiple ({pack_multiple}) must be a multiple of pad_multiple "
                         f"({pad_multiple}); use megatron_pack.config.layout.pack_multiple.")
    ids, masks, sample_ids = _read_samples(samples)
    num_ids = np.fromiter((x.size for x in ids), dtype=np.int64, count=len(ids))
    real, padded = _layout(num_ids - 1, pad_multiple, pack_size, pad_to_max_length, sample_ids, pack_multiple)
    cu_real, cu_padded = _cumsum0(real), _cumsum0(padded)
    num_tokens = int(cu_padded[-1])

    # sub-sequence i fills [cu_padded[i], cu_padded[i] + real[i]): one slice copy per sample, no per-token loop
    tokens = np.full(num_tokens, pad_id, dtype=np.int64)
    labels = np.full(num_tokens, pad_id, dtype=np.int64)
    loss_mask = np.zeros(num_tokens, dtype=np.float32)
    for x, m, start in zip(ids, masks, cu_padded.tolist()):
        end = start + x.size - 1
        tokens[start:end], labels[start:end], loss_mask[start:end] = x[:-1], x[1:], m[1:]
    if np.any((loss_mask != 0) & (loss_mask != 1)):
        raise ValueError(f"pack with sample_ids {sample_ids.tolist()} has loss_mask values other than 0 and 1; "
                         "the answer mask must be 0/1: re-run `megatron-pack prepare`.")
    position_ids = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu_padded[:-1], padded)

    longest = int(padded.max(initial=0))
    if max_seqlen is None:
        max_seqlen = pack_size if num_cu_seqlens is not None else longest
    elif max_seqlen < longest:
        raise ValueError(f"max_seqlen ({max_seqlen}) is shorter than a padded sub-sequence ({longest}) of the pack "
                         f"with sample_ids {sample_ids.tolist()}; pass the dataset-wide maximum (or pack_size).")
    num_real = int(cu_real[-1])
    return {
        "tokens": torch.from_numpy(tokens).unsqueeze(0),
        "labels": torch.from_numpy(labels).unsqueeze(0),
        "loss_mask": torch.from_numpy(loss_mask).unsqueeze(0),
        "position_ids": torch.from_numpy(position_ids).unsqueeze(0),
        "cu_seqlens": torch.from_numpy(_fixed_length(cu_real, num_cu_seqlens, sample_ids).astype(np.int32)),
        "cu_seqlens_padded": torch.from_numpy(_fixed_length(cu_padded, num_cu_seqlens, sample_ids).astype(np.int32)),
        "max_seqlen": int(max_seqlen),
        "sample_ids": torch.from_numpy(sample_ids),
        "num_real_tokens": num_real,
        "num_pad_tokens": num_tokens - num_real,
        "num_target_tokens": int(loss_mask.sum(dtype=np.float64)),
    }


def collate_cross(samples: Sequence[Mapping[str, Any]], *, pack_size: int, pad_multiple: int = 1,
                  pad_to_max_length: bool = False, num_cu_seqlens: Optional[int] = None, pad_id: int = 0,
                  max_seqlen: Optional[int] = None, pack_multiple: int = 1) -> dict:
    """One ``wrapped_attention=cross`` row -> a THD batch with a single sequence (plus the padding tail
    with ``pad_to_max_length``).

    The row's pieces are collated as usual (the plan laid them without alignment padding), then
    merged: ``cu_seqlens = [0, R]`` (R real tokens), padded as a whole to the pad multiple (and the
    pack to ``pack_multiple`` by a tail, as in ``collate_thd``), position ids ``0 .. T-1`` across the row. Labels and the loss mask are unchanged, so labels
    never cross a document (its last position predicts its own eos); only attention crosses.
    Example, pieces ``[A, B, EOS]`` and ``[C, D, EOS]``: tokens ``[A, B, C, D]``, labels
    ``[B, EOS, D, EOS]``, position_ids ``[0, 1, 2, 3]``, cu_seqlens ``[0, 4]`` (a document-mode
    pack gives ``[0, 2, 4]`` and positions ``[0, 1, 0, 1]``).
    """
    pieces = collate_thd(samples, pack_size=pack_size, pad_multiple=1, pad_id=pad_id)
    real = int(pieces["cu_seqlens"][-1])
    padded = round_up(real, pad_multiple)
    total = _total(padded, pack_size, pad_to_max_length, pack_multiple)
    out = {}
    for key in ("tokens", "labels", "loss_mask"):
        fill = 0 if key == "loss_mask" else pad_id
        value = torch.full((1, total), fill, dtype=pieces[key].dtype)
        value[0, :real] = pieces[key][0, :real]
        out[key] = value
    cu_real, cu_padded = [0, real], [0, padded]
    if total > padded:  # the tail after the row: one more sub-sequence of zero real length
        cu_real, cu_padded = cu_real + [real], cu_padded + [total]
    sample_ids = pieces["sample_ids"].numpy()
    out["position_ids"] = (torch.arange(total) - torch.tensor(np.repeat(cu_padded[:-1], np.diff(cu_padded)))).unsqueeze(0)
    out["cu_seqlens"] = torch.from_numpy(_fixed_length(np.array(cu_real), num_cu_seqlens, sample_ids).astype(np.int32))
    out["cu_seqlens_padded"] = torch.from_numpy(
        _fixed_length(np.array(cu_padded), num_cu_seqlens, sample_ids).astype(np.int32))
    longest = int(np.diff(cu_padded).max())
    out["max_seqlen"] = int(max_seqlen if max_seqlen is not None and max_seqlen >= longest else
                            (pack_size if num_cu_seqlens is not None else longest))
    out["sample_ids"] = pieces["sample_ids"]
    out.update(num_real_tokens=real, num_pad_tokens=total - real, num_target_tokens=pieces["num_target_tokens"])
    return out

def _metadata_max_seqlen(metadata: Mapping[str, Any], pack_size: int, pad_multiple: int,
                         pad_to_max_length: bool, pack_multiple: int = 1) -> int:
    """A dataset-wide bound on every padded sub-sequence (fixed shapes for CUDA graphs); a
    ``pack_multiple`` tail is shorter than ``pack_multiple``."""
    longest = metadata.get("dataset_max_seqlen")
    if pad_to_max_length or longest is None:
        return pack_size  # the padding tail can be as long as the pack
    return min(pack_size, max(round_up(int(longest), pad_multiple), pack_multiple))


def make_collate_fn(metadata: Mapping[str, Any], *, pad_multiple: Optional[int] = None,
                    pad_to_max_length: bool = False, pad_cu_seqlens: bool = False,
                    pad_id: Optional[int] = None, pack_multiple: Optional[int] = None
                    ) -> Callable[[Sequence[Mapping[str, Any]]], dict]:
    """The data loader's collate: one pack (a list of samples) -> one THD batch.

    ``metadata`` is the packed dataset's plan metadata (``pack_size``, ``max_samples_per_bin``,
    ``dataset_max_seqlen``, ``pad_seq_to_mult``, ``pack_multiple``, ``pad_id``). ``pad_multiple``,
    ``pack_multiple`` and ``pad_id`` default to the metadata's (a plan without ``pack_multiple``
    pads packs only to the pad multiple). With ``pad_cu_seqlens`` the cu_seqlens arrays get
    ``max_samples_per_bin + 2`` entries and ``max_seqlen`` is fixed: ``pack_size`` with
    ``pad_to_max_length`` (the tail can be that long), else ``dataset_max_seqlen`` rounded up to
    the pad multiple. Returns a picklable ``functools.partial`` of ``collate_thd`` (of
    ``collate_cross`` for a ``wrapped_attention=cross`` plan); a bucketed plan's batches
    also carry ``bucket`` (an int: the pack's length bucket).
    """
    pack_size = int(metadata["pack_size"])
    multiple = int(pad_multiple if pad_multiple is not None else metadata.get("pad_seq_to_mult", 1))
    pad = int(pad_id if pad_id is not None else metadata.get("pad_id", 0))
    whole = math.lcm(multiple, int(pack_multiple if pack_multiple is not None else metadata.get("pack_multiple", 1)))
    num_cu_seqlens = max_seqlen = None
    if pad_cu_seqlens:
        if metadata.get("max_samples_per_bin") is None:
            raise ValueError("packing.pad_cu_seqlens=true needs max_samples_per_bin in the packed dataset's metadata; "
                             "re-run `megatron-pack prepare` to write it.")
        num_cu_seqlens = int(metadata["max_samples_per_bin"]) + 2
        max_seqlen = _metadata_max_seqlen(metadata, pack_size, multiple, pad_to_max_length, whole)
    collate: Callable = collate_thd
    if metadata.get("wrapped_attention") == "cross":  # packing.algorithm=wrapped: one sequence per row
        collate = collate_cross
    inner = functools.partial(collate, pack_size=pack_size, pad_multiple=multiple,
                              pad_to_max_length=pad_to_max_length, num_cu_seqlens=num_cu_seqlens,
                              pad_id=pad, max_seqlen=max_seqlen, pack_multiple=whole)
    if "buckets" not in metadata and "source_names" not in metadata:
        return inner
    return functools.partial(with_groups, inner, num_sources=len(metadata.get("source_names", [])),
                             cross=metadata.get("wrapped_attention") == "cross")


def with_groups(collate: Callable, samples: Sequence[Mapping[str, Any]], *, num_sources: int = 0,
                cross: bool = False) -> dict:
    """``collate(samples)`` plus what per-bucket and per-source metrics need.

    ``bucket`` (int): the pack's length bucket (from ``samples[0]["bucket"]``, 0 without one).
    With ``num_sources > 0``: ``token_source`` int64 [1, T], the source index of the sample each
    position belongs to (-1 on padding; sliced by CP like the tokens), and ``num_sources``.
    Example: samples of 3 and 2 ids from sources 1 and 0, pad multiple 2 -> ``[[1, 1, 0, -1]]``.
    """
    batch = collate(samples)
    batch["bucket"] = int(samples[0].get("bucket", 0))
    if num_sources:
        lengths = np.array([len(s["input_ids"]) - 1 for s in samples], dtype=np.int64)
        starts = (_cumsum0(lengths)[:-1] if cross else batch["cu_seqlens_padded"][:len(samples)].numpy())
        token_source = np.full(batch["tokens"].shape[-1], -1, dtype=np.int64)
        for s, start, n in zip(samples, starts.tolist(), lengths.tolist()):
            token_source[start:start + n] = int(s.get("source", 0))
        batch["token_source"] = torch.from_numpy(token_source).unsqueeze(0)
        batch["num_sources"] = num_sources
    return batch
