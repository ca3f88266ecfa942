"""Packing plans on disk: which store samples go into which pack, under an overflow policy.

A plan directory sits under ``<store>/plans/`` and holds (``B`` packs, ``K`` packed samples)::

    bin_offsets.npy     int64 [B+1]  pack b is sample_order[bin_offsets[b]:bin_offsets[b+1]]
    sample_order.npy    int64 [K]    store sample indices, pack after pack
    sample_num_ids.npy  int32 [K]    ids to read for each entry (fewer than stored when truncated)
    metadata.json                    settings, Megatron-Bridge fields, accounting, sha256 of the arrays

Its name carries the settings and a fingerprint of (store, pack size, pad multiple, algorithm,
seed, overflow policy, max length), so several plans share one store and re-planning never
re-tokenizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_pack.data.store.atomic import atomic_directory, sha256_file, write_json
from megatron_pack.data.packing.algorithms import lower_bound_bins, plan_packing, thd_lengths
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.store.metadata import (PLAN_FORMAT, PLAN_FORMAT_VERSION, VALIDATION_DIRNAME, PlanSettings,
                                               held_out_mask)
from megatron_pack.data.store.token_store import TokenStore

PLAN_ARRAYS = ("bin_offsets", "sample_order", "sample_num_ids")
NUM_OFFENDERS_SHOWN = 5


@dataclass
class Selection:
    """The samples a plan packs, and the accounting of those it does not."""

    kept: np.ndarray
    num_ids: np.ndarray
    dropped: dict
    num_truncated: int


def select_samples(store: TokenStore, settings: PlanSettings, include=None) -> Selection:
    """Apply the empty-sample rule and the overflow policy; ``error`` raises listing offenders.

    ``include`` (bool [num samples], default all) limits the plan to those samples (the training
    or the held-out validation share); the others are neither packed nor counted as dropped."""
    if settings.truncate_to < 1:
        raise DataError(f"packing.packed_sequence_size ({settings.pack_size}) is smaller than the pad multiple "
                        f"({settings.pad_multiple}); raise it to a multiple of {settings.pad_multiple}.")
    num_ids = store.num_ids()
    empty = np.asarray(store.num_targets) == 0
    padded = thd_lengths(num_ids, settings.pad_multiple)
    include = np.ones(len(num_ids), dtype=bool) if include is None else np.asarray(include, dtype=bool)
    empty = empty & include
    over = ((num_ids - 1 > settings.max_length) | (padded > settings.pack_size)) & ~empty & include
    dropped = {"no_answer_tokens": int(empty.sum()), "too_long": 0, "no_answer_tokens_after_truncation": 0}
    take = num_ids.copy()
    if over.any() and settings.on_overflow == "error":
        raise DataError(_overflow_message(store, settings, np.flatnonzero(over), padded))
    if settings.on_overflow == "drop":
        dropped["too_long"] = int(over.sum())
        keep = ~empty & ~over & include
    else:
        keep = ~empty & include
        for i in np.flatnonzero(over):
            take[i] = settings.truncate_to + 1
            start = int(store.offsets[i])
            if not np.any(store.answer_mask[start + 1:start + take[i]]):
                keep[i] = False
                dropped["no_answer_tokens_after_truncation"] += 1
    kept = np.flatnonzero(keep)
    num_truncated = int((over & keep).sum()) if settings.on_overflow == "truncate" else 0
    return Selection(kept, take[kept].astype(np.int32), dropped, num_truncated)


def _overflow_message(store: TokenStore, settings: PlanSettings, offenders: np.ndarray, padded) -> str:
    lines = [f"  {store.where(i)}: THD length {int(store.offsets[i + 1] - store.offsets[i]) - 1} "
             f"(padded {int(padded[i])})" for i in offenders[:NUM_OFFENDERS_SHOWN]]
    more = f"\n  ... and {len(offenders) - NUM_OFFENDERS_SHOWN} more" if len(offenders) > NUM_OFFENDERS_SHOWN else ""
    return (f"{len(offenders)} sample(s) are longer than the pack allows (pack size {settings.pack_size}, "
            f"pad multiple {settings.pad_multiple}, max length {settings.max_length}):\n" + "\n".join(lines) + more +
            "\nSet packing.on_overflow=drop or packing.on_overflow=truncate, or raise "
            "packing.packed_sequence_size / packing.max_single_sequence_length.")


def plan_metadata(store: TokenStore, settings: PlanSettings, selection: Selection, plan,
                  num_held_out: int = 0) -> dict:
    """Megatron-Bridge fields, our settings and the accounting of every sample read
    (``num_held_out``: samples of the store this plan leaves to another, e.g. validation)."""
    thd = selection.num_ids.astype(np.int64) - 1
    loads = plan.bin_loads()
    num_read = len(store)
    num_dropped = sum(selection.dropped.values())
    if num_read != len(selection.kept) + num_dropped + num_held_out:
        raise AssertionError(f"accounting broken: read {num_read} != packed {len(selection.kept)} + dropped "
                             f"{num_dropped} + held out {num_held_out}")
    meta = store.metadata
    return {
        "pack_size": settings.pack_size,
        "max_samples_per_bin": int(plan.bin_sizes().max()) if plan.num_bins else 0,
        "dataset_max_seqlen": int(thd.max()) if thd.size else 0,
        "min_packed_seqlen": int(loads.min()) if plan.num_bins else 0,
        "packing_factor": round(len(thd) / plan.num_bins, 2) if plan.num_bins else 0.0,
        "packing_efficiency": round(100 * plan.efficiency, 2),
        "pad_seq_to_mult": settings.pad_multiple, "algorithm": settings.algorithm, "seed": settings.seed,
        "on_overflow": settings.on_overflow, "max_single_sequence_length": settings.max_length,
        "num_bins": plan.num_bins, "lower_bound_bins": lower_bound_bins(plan.lengths, settings.pack_size),
        "num_tokens": int(thd.sum()), "num_alignment_padding_tokens": int(plan.lengths.sum() - thd.sum()),
        "num_padding_tokens": int(plan.num_bins * settings.pack_size - thd.sum()),
        "vocab_size": meta["vocab_size"], "tokenizer": meta["tokenizer"], "pad_id": meta["pad_id"],
        "eos_id": meta["eos_id"], "bos_id": meta["bos_id"],
        "accounting": {"num_samples_read": num_read, "num_samples_packed": len(selection.kept),
                       "num_samples_dropped": selection.dropped, "num_samples_truncated": selection.num_truncated,
                       "num_samples_held_out": num_held_out, "balanced": True},
    }


def write_plan(store: TokenStore, settings: PlanSettings) -> Path:
    """Plan ``store`` under ``settings`` into ``<store>/plans/<name>`` (atomically); return the directory.

    With ``settings.validation_fraction`` > 0 the held-out samples (``held_out_mask``, chosen
    before packing) are packed into their own plan ``<name>/validation`` with the same settings;
    the training plan never holds them, and both metadata files record the split. Nothing is
    written when either plan cannot be made."""
    target = store.path / "plans" / settings.dirname(store.metadata["fingerprint"])
    held = (held_out_mask(len(store), settings.validation_fraction, settings.validation_seed)
            if settings.validation_fraction else np.zeros(len(store), dtype=bool))
    if settings.validation_fraction and not held.any():
        raise DataError(f"data.validation_fraction ({settings.validation_fraction}) of {len(store)} samples holds "
                        "out none; raise data.validation_fraction or prepare more samples.")
    split = {"validation_fraction": settings.validation_fraction, "validation_seed": settings.validation_seed,
             "num_samples_held_out": int(held.sum())}
    plans = [("", _make_plan(store, settings, ~held, {**split, "role": "train"}))]
    if held.any():
        plans.append((VALIDATION_DIRNAME, _make_plan(store, settings, held, {**split, "role": "validation"})))
    with atomic_directory(target, replace=True) as tmp:
        for subdir, arrays in plans:
            (tmp / subdir).mkdir(exist_ok=True)
            _write_plan_arrays(tmp / subdir, store, settings, *arrays)
    return target


def _make_plan(store: TokenStore, settings: PlanSettings, include: np.ndarray, split: dict):
    selection = select_samples(store, settings, include)
    if selection.kept.size == 0:
        raise DataError(f"no sample of {store.path} is left to pack (dropped: {selection.dropped}); check "
                        "data.answer_only_loss, data.schema, packing.on_overflow and data.validation_fraction.")
    plan = plan_packing(thd_lengths(selection.num_ids, settings.pad_multiple), settings.pack_size,
                        settings.algorithm, settings.seed)
    metadata = plan_metadata(store, settings, selection, plan, num_held_out=int((~include).sum()))
    metadata["split"] = split
    return selection, plan, metadata


def _write_plan_arrays(directory: Path, store: TokenStore, settings: PlanSettings, selection: Selection, plan,
                       metadata: dict) -> None:
    np.save(directory / "bin_offsets.npy", plan.bin_offsets.astype(np.int64), allow_pickle=False)
    np.save(directory / "sample_order.npy", selection.kept[plan.order].astype(np.int64), allow_pickle=False)
    np.save(directory / "sample_num_ids.npy", selection.num_ids[plan.order], allow_pickle=False)
    metadata.update(format=PLAN_FORMAT, format_version=PLAN_FORMAT_VERSION,
                    store_fingerprint=store.metadata["fingerprint"],
                    fingerprint=settings.fingerprint(store.metadata["fingerprint"]),
                    files={f"{name}.npy": {"sha256": sha256_file(directory / f"{name}.npy"),
                                           "size": (directory / f"{name}.npy").stat().st_size} for name in PLAN_ARRAYS})
    write_json(directory / "metadata.json", metadata)


def plan_lengths(plan_dir: Path, pad_multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """Padded lengths of every packed sample and the bin offsets (for reports)."""
    offsets = np.load(plan_dir / "bin_offsets.npy", allow_pickle=False)
    num_ids = np.load(plan_dir / "sample_num_ids.npy", allow_pickle=False)
    return thd_lengths(num_ids, pad_multiple), offsets
