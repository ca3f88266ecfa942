"""Packing plans on disk: which store samples go into which pack, under an overflow policy.

A plan directory sits under ``<store>/plans/`` and holds (``B`` packs, ``K`` packed samples)::

    bin_offsets.npy     int64 [B+1]  pack b is sample_order[bin_offsets[b]:bin_offsets[b+1]]
    sample_order.npy    int64 [K]    store sample indices, pack after pack
    sample_num_ids.npy  int32 [K]    ids to read for each entry (fewer than stored when truncated)
    sample_start.npy    int64 [K]    (split / wrapped only) first id of each entry inside its sample
    sample_piece.npy    int32 [K]    (split / wrapped only) piece index of each entry inside its sample
    bin_bucket.npy      int32 [B]    (packing.buckets only) length bucket of each pack
    sample_source.npy   int32 [K]    (data.sources only) source index of each entry (metadata source_names)
    metadata.json                    settings, Megatron-Bridge fields, accounting, sha256 of the arrays

Its ``metadata.json`` records the manifest (``megatron_pack.data.store.manifest``: every setting that
shaped the plan), and its name carries the main settings and a fingerprint of (store, manifest), so
several plans share one store and re-planning never re-tokenizes.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_pack.data.store.atomic import atomic_directory, sha256_file, write_json
from megatron_pack.data.packing.algorithms import PackingPlan, lower_bound_bins, plan_packing, thd_lengths
from megatron_pack.data.packing.buckets import assign_buckets, bucket_boundaries, bucket_statistics, plan_buckets
from megatron_pack.data.packing.mixing import mix_selection
from megatron_pack.data.packing.rules import select
from megatron_pack.data.packing.split import piece_loss_mask, split_entries
from megatron_pack.data.packing.wrapped import wrapped_entries
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.store import manifest as manifests
from megatron_pack.data.store.metadata import (PLAN_FORMAT, PLAN_FORMAT_VERSION, VALIDATION_DIRNAME, PlanSettings,
                                               held_out_mask)
from megatron_pack.data.store.token_store import TokenStore

PLAN_ARRAYS = ("bin_offsets", "sample_order", "sample_num_ids")
OPTIONAL_PLAN_ARRAYS = ("sample_start", "sample_piece", "bin_bucket", "sample_source")
"""Written only by split / wrapped plans (first id and piece index of each entry) and bucketed plans
(each pack's bucket); a plan without them reads as starts 0, pieces 0, one bucket."""


@dataclass
class Selection:
    """The entries a plan packs (whole samples, or pieces of split ones), and the accounting of
    the samples it does not pack."""

    kept: np.ndarray
    """int64 [K]: the store sample of every entry (a split sample appears once per piece)."""
    num_ids: np.ndarray
    """int32 [K]: ids each entry reads."""
    dropped: dict
    num_truncated: int
    starts: np.ndarray | None = None
    """int64 [K]: first id of each entry inside its sample (pieces); None means all 0."""
    pieces: np.ndarray | None = None
    """int32 [K]: piece index of each entry inside its sample; None means all 0."""
    num_split: int = 0
    """Samples cut into pieces (on_overflow=split)."""
    num_pieces_without_answer: int = 0
    """Pieces left out because none of their own targets is an answer token (counted, per piece)."""

    @property
    def num_samples(self) -> int:
        """Distinct samples packed (pieces of a sample, and repeats from mixing, count once)."""
        return int(np.unique(self.kept).size)


def select_samples(store: TokenStore, settings: PlanSettings, include=None) -> Selection:
    """Apply the per-sample rules (``rules.select``: empty samples, the overflow policy) to the store;
    ``error`` raises listing offenders, ``split`` cuts the over-long ones into pieces.

    ``include`` (bool [num samples], default all) limits the plan to those samples (the training
    or the held-out validation share); the others are neither packed nor counted as dropped."""
    num_ids = store.num_ids()

    def answer_after_truncation(i: int, take: int) -> bool:
        start = int(store.offsets[i])
        return bool(np.any(store.answer_mask[start + 1:start + take]))

    cuts_image = None
    if store.images is not None:
        from megatron_pack.data.packing.images import check_image_plan, image_cut_rule

        check_image_plan(store, settings, include)
        cuts_image = image_cut_rule(store)
    chosen = select(num_ids, store.num_targets, settings, answer_after_truncation=answer_after_truncation,
                    where=store.where, include=include, cuts_image=cuts_image)
    if settings.on_overflow == "split":
        return _split_selection(store, settings, chosen.keep, chosen.over, num_ids, chosen.dropped)
    kept = np.flatnonzero(chosen.keep)
    return Selection(kept, chosen.num_ids[kept].astype(np.int32), chosen.dropped, chosen.num_truncated)


def lost_data(store: TokenStore, settings: PlanSettings, include: np.ndarray, entries: Selection,
              selected: np.ndarray | None = None) -> dict:
    """Positions (THD tokens: ``n - 1`` per sample of ``n`` ids) and answer targets of the plan's samples:
    read, kept in its packs (each once: repeated context and mixing repeats count once), lost to the
    overflow policy (truncated tails, pieces without an answer, over-long samples dropped) and lost with
    dropped records (no answer tokens, not selected by the mixture); ``read = kept + both losses``.

    ``selected`` are the samples the overflow policy kept (before mixing; default: those packed): a sample
    it did not keep is lost to it (or, without targets, a dropped record), one it kept that is not packed
    was left out by the mixture (a dropped record).

    Example (pack 16, truncate): a sample of 22 ids with targets on its last 11 keeps 17 ids, so 16 of its
    21 positions and 6 of its 11 targets; 5 positions and 5 targets are lost to the policy."""
    num_ids, num_targets = store.num_ids().astype(np.int64), np.asarray(store.num_targets, dtype=np.int64)
    domain = np.flatnonzero(include)
    starts = entries.starts if entries.starts is not None else np.zeros(len(entries.kept), np.int64)
    pieces = entries.pieces if entries.pieces is not None else np.zeros(len(entries.kept), np.int32)
    pairs, first = np.unique(np.stack([entries.kept, starts]), axis=1, return_index=True)
    sample, start = pairs
    num, piece = entries.num_ids[first].astype(np.int64), pieces[first]
    overlap = np.where(piece > 0, settings.split_overlap, 0)
    kept_tokens = int((num - 1 - overlap).sum())
    whole = (start == 0) & (num == num_ids[sample])
    kept_targets = int(num_targets[sample[whole]].sum())
    for i in np.flatnonzero(~whole):  # truncated samples and pieces: their own slice of the answer mask
        lo = int(store.offsets[sample[i]] + start[i])
        mask = piece_loss_mask(store.answer_mask[lo:lo + num[i]], int(piece[i]), settings.split_overlap)
        kept_targets += int(mask[1:].sum())
    selected = np.unique(sample) if selected is None else np.unique(selected)
    by_policy = np.setdiff1d(domain, selected)  # the policy's drops: records without targets are not its
    by_records = np.concatenate([by_policy[num_targets[by_policy] == 0], np.setdiff1d(selected, sample)])
    read = (int((num_ids[domain] - 1).sum()), int(num_targets[domain].sum()))
    lost_records = (int((num_ids[by_records] - 1).sum()), int(num_targets[by_records].sum()))
    return {"tokens": _kept_and_lost(read[0], kept_tokens, lost_records[0]),
            "answer_targets": _kept_and_lost(read[1], kept_targets, lost_records[1]),
            "on_overflow": settings.on_overflow,
            "num_records_skipped": int((store.metadata.get("bad_records") or {}).get("num_skipped", 0))}


def _kept_and_lost(read: int, kept: int, lost_records: int) -> dict:
    by_policy = read - kept - lost_records
    if by_policy < 0:
        raise AssertionError(f"lost-data accounting broken: read {read} < kept {kept} + lost with dropped records "
                             f"{lost_records}")
    return {"read": read, "kept": kept, "lost_to_overflow": by_policy, "lost_to_dropped_records": lost_records}


def _split_selection(store: TokenStore, settings: PlanSettings, whole: np.ndarray, over: np.ndarray,
                     num_ids: np.ndarray, dropped: dict) -> Selection:
    """Whole samples that fit, plus the pieces (``split.split_entries``) of the over-long ones."""
    whole = np.flatnonzero(whole)
    sample, start, num, piece, num_empty = split_entries(np.flatnonzero(over), store.offsets, store.answer_mask,
                                                         settings.truncate_to, settings.split_overlap)
    kept = np.concatenate([whole, sample]).astype(np.int64)
    order = np.argsort(kept, kind="stable")  # store order, pieces of a sample in piece order
    return Selection(kept[order], np.concatenate([num_ids[whole], num]).astype(np.int32)[order], dropped, 0,
                     starts=np.concatenate([np.zeros(len(whole), np.int64), start])[order],
                     pieces=np.concatenate([np.zeros(len(whole), np.int32), piece])[order],
                     num_split=int(over.sum()), num_pieces_without_answer=num_empty)


@dataclass
class Layout:
    """A plan over entries: ``plan.order`` indexes ``entries``; ``bin_bucket`` names each pack's bucket."""

    plan: PackingPlan
    entries: Selection
    bin_bucket: np.ndarray | None = None
    extra: dict | None = None
    """Metadata the strategy adds (``buckets``, ``wrapped_attention``)."""


def lay_out(selection: Selection, settings: PlanSettings) -> Layout:
    """Place the selected entries into packs: the wrapped stream, buckets, or one plan."""
    if settings.algorithm == "wrapped":
        return _wrapped_layout(selection, settings)
    lengths = thd_lengths(selection.num_ids, settings.pad_multiple)
    if settings.buckets is None:
        return Layout(plan_packing(lengths, settings.pack_size, settings.algorithm, settings.seed), selection)
    thd = selection.num_ids.astype(np.int64) - 1
    boundaries = bucket_boundaries(settings.buckets, thd)
    bucket_of = assign_buckets(thd, boundaries)
    plan, bin_bucket = plan_buckets(lengths, bucket_of, len(boundaries) + 1, settings.pack_size,
                                    settings.algorithm, settings.seed)
    stats = bucket_statistics(plan, thd, bucket_of, bin_bucket, boundaries, selection.kept)
    spec = settings.buckets if settings.buckets == "auto" else list(settings.buckets)
    return Layout(plan, selection, bin_bucket, {"buckets": {"spec": spec, "boundaries": boundaries,
                                                            "per_bucket": stats}})


def _wrapped_layout(selection: Selection, settings: PlanSettings) -> Layout:
    cross = settings.wrapped_attention == "cross"
    multiple = 1 if cross else settings.pad_multiple  # cross: one sequence per row, padded as a whole
    doc, start, num, piece, offsets = wrapped_entries(selection.num_ids, settings.pack_size, multiple, settings.seed)
    entries = Selection(selection.kept[doc], num, selection.dropped, 0, starts=start, pieces=piece,
                        num_split=int(np.unique(doc[piece > 0]).size))
    plan = PackingPlan(np.arange(len(doc), dtype=np.int64), offsets, thd_lengths(num, multiple), settings.pack_size)
    return Layout(plan, entries, None, {"wrapped_attention": settings.wrapped_attention})


def plan_metadata(store: TokenStore, settings: PlanSettings, selection: Selection, layout: Layout,
                  num_held_out: int = 0, include: np.ndarray | None = None, selected: np.ndarray | None = None) -> dict:
    """Megatron-Bridge fields, our settings and the accounting of every sample read
    (``num_held_out``: samples of the store this plan leaves to another, e.g. validation; ``include``:
    the samples this plan was made from, default all) and of their tokens and targets (``lost_data``)."""
    plan, entries = layout.plan, layout.entries
    thd = entries.num_ids.astype(np.int64) - 1
    loads = plan.bin_loads()
    num_read = len(store)
    num_dropped = sum(selection.dropped.values())
    if num_read != entries.num_samples + num_dropped + num_held_out:
        raise AssertionError(f"accounting broken: read {num_read} != packed {entries.num_samples} + dropped "
                             f"{num_dropped} + held out {num_held_out}")
    meta = store.metadata
    cross = settings.algorithm == "wrapped" and settings.wrapped_attention == "cross"
    out = {
        "pack_size": settings.pack_size,
        # cross: the whole row is one attention sequence, so one sub-sequence per pack (plus the padding tail)
        "max_samples_per_bin": (1 if cross else int(plan.bin_sizes().max())) if plan.num_bins else 0,
        "dataset_max_seqlen": (int(loads.max()) if cross else int(thd.max())) if thd.size else 0,
        "min_packed_seqlen": int(loads.min()) if plan.num_bins else 0,
        "packing_factor": round(len(thd) / plan.num_bins, 2) if plan.num_bins else 0.0,
        "packing_efficiency": round(100 * plan.efficiency, 2),
        "pad_seq_to_mult": settings.pad_multiple, "pack_multiple": math.lcm(settings.pad_multiple, settings.pack_multiple),
        "algorithm": settings.algorithm, "seed": settings.seed,
        "on_overflow": settings.on_overflow, "max_single_sequence_length": settings.max_length,
        "split_overlap": settings.split_overlap,
        "num_bins": plan.num_bins, "lower_bound_bins": lower_bound_bins(plan.lengths, settings.pack_size),
        "num_tokens": int(thd.sum()), "num_alignment_padding_tokens": int(plan.lengths.sum() - thd.sum()),
        "num_padding_tokens": int(plan.num_bins * settings.pack_size - thd.sum()),
        "vocab_size": meta["vocab_size"], "tokenizer": meta["tokenizer"], "pad_id": meta["pad_id"],
        "eos_id": meta["eos_id"], "bos_id": meta["bos_id"],
        **({"images": meta["images"]} if "images" in meta else {}),
        "accounting": {"num_samples_read": num_read, "num_samples_packed": entries.num_samples,
                       "num_samples_dropped": selection.dropped, "num_samples_truncated": selection.num_truncated,
                       "num_samples_split": entries.num_split or selection.num_split,
                       "num_packed_entries": len(thd),
                       "num_pieces_without_answer": selection.num_pieces_without_answer,
                       "num_samples_held_out": num_held_out, "balanced": True,
                       # bad records data.on_bad_record=skip left out of the store (never tokenized), by reason
                       "num_records_skipped": int((meta.get("bad_records") or {}).get("num_skipped", 0))},
    }
    out["lost_data"] = lost_data(store, settings, np.ones(num_read, bool) if include is None else include, entries,
                                 selected)
    out.update(layout.extra or {})
    return out


def write_plan(store: TokenStore, settings: PlanSettings, manifest: dict) -> Path:
    """Plan ``store`` under ``settings`` into ``<store>/plans/<name>`` (atomically); return the directory.
    ``manifest`` (``manifest.build_manifest`` of the same config) is recorded and names the plan.

    With ``settings.validation_fraction`` > 0 the held-out samples (``held_out_mask``, chosen
    before packing) are packed into their own plan ``<name>/validation`` with the same settings;
    the training plan never holds them, and both metadata files record the split. Nothing is
    written when either plan cannot be made."""
    target = store.path / "plans" / manifests.dirname(manifest, store.metadata["fingerprint"])
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
            _write_plan_arrays(tmp / subdir, store, manifest, *arrays)
    return target


def _make_plan(store: TokenStore, settings: PlanSettings, include: np.ndarray, split: dict):
    selection = select_samples(store, settings, include)
    selected = selection.kept  # before mixing: what the overflow policy kept
    if selection.kept.size == 0:
        raise DataError(f"no sample of {store.path} is left to pack (dropped: {selection.dropped}); check "
                        "data.answer_only_loss, data.schema, packing.on_overflow and data.validation_fraction.")
    mixture = None
    # the held-out validation share is packed as it is, each sample once: mixing would drop some and
    # repeat others (a token budget sized for training would repeat them many times), and the
    # per-source validation losses do not depend on the shares
    if settings.mixture is not None and split.get("role") != "validation":
        selection, mixture = _mix(store, settings, selection)
    layout = lay_out(selection, settings)
    metadata = plan_metadata(store, settings, selection, layout, num_held_out=int((~include).sum()), include=include,
                             selected=selected)
    metadata["split"] = split
    if mixture is not None:
        metadata["mixture"] = mixture
    entries, order = layout.entries, layout.plan.order
    arrays = {"bin_offsets": layout.plan.bin_offsets.astype(np.int64),
              "sample_order": entries.kept[order].astype(np.int64),
              "sample_num_ids": entries.num_ids[order].astype(np.int32)}
    if entries.starts is not None:
        arrays.update(sample_start=entries.starts[order].astype(np.int64),
                      sample_piece=entries.pieces[order].astype(np.int32))
    if layout.bin_bucket is not None:
        arrays["bin_bucket"] = layout.bin_bucket.astype(np.int32)
    file_source = source_of_files(store.metadata)
    if file_source is not None:  # every pack records its samples' source
        arrays["sample_source"] = file_source[np.asarray(store.source_file)[arrays["sample_order"]]].astype(np.int32)
        metadata["source_names"] = [m["name"] for m in store.metadata["sources"]["mixture"]]
    return arrays, metadata


def _write_plan_arrays(directory: Path, store: TokenStore, manifest: dict, arrays: dict, metadata: dict) -> None:
    for name, array in arrays.items():
        np.save(directory / f"{name}.npy", array, allow_pickle=False)
    metadata.update(format=PLAN_FORMAT, format_version=PLAN_FORMAT_VERSION,
                    store_fingerprint=store.metadata["fingerprint"], manifest=manifest,
                    fingerprint=manifests.fingerprint(manifest, store.metadata["fingerprint"]),
                    files={f"{name}.npy": {"sha256": sha256_file(directory / f"{name}.npy"),
                                           "size": (directory / f"{name}.npy").stat().st_size} for name in arrays})
    write_json(directory / "metadata.json", metadata)


def source_of_files(store_metadata: dict) -> np.ndarray | None:
    """Source index of every input file of a store built from data.sources (None for one input)."""
    files = store_metadata["sources"].get("files", [])
    if "mixture" not in store_metadata["sources"]:
        return None
    return np.array([f["source"] for f in files], dtype=np.int32)


def _mix(store: TokenStore, settings: PlanSettings, selection: Selection) -> tuple[Selection, dict]:
    """Up/down-sample the selection to the data.sources shares (``mixing.mix_selection``)."""
    file_source = source_of_files(store.metadata)
    names = [m["name"] for m in store.metadata["sources"]["mixture"]] if file_source is not None else []
    if names != [m[0] for m in settings.mixture]:
        raise DataError(f"the token store at {store.path} holds sources {names}, but data.sources names "
                        f"{[m[0] for m in settings.mixture]}; re-run `megatron-pack prepare` with this data.sources.")
    entry_source = file_source[np.asarray(store.source_file)[selection.kept]]
    kind = settings.mixture[0][1]
    mixed, _, stats = mix_selection(selection, entry_source, names, kind, [m[2] for m in settings.mixture],
                                    settings.seed, settings.pack_size)
    for s in stats:
        if s["num_samples_selected"] == 0:
            raise DataError(f"data.sources {s['name']!r} has no sample left to pack (available tokens "
                            f"{s['available_tokens']}, target {s['target_tokens']}); check its input, "
                            "data.answer_only_loss and packing.on_overflow.")
    return mixed, {"kind": kind, "per_source": stats}


def plan_lengths(plan_dir: Path, pad_multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """Padded lengths of every packed sample and the bin offsets (for reports)."""
    offsets = np.load(plan_dir / "bin_offsets.npy", allow_pickle=False)
    num_ids = np.load(plan_dir / "sample_num_ids.npy", allow_pickle=False)
    return thd_lengths(num_ids, pad_multiple), offsets
