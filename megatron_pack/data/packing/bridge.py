"""Export a plan as Megatron-Bridge's packed parquet, so a Bridge user can train on our packs.

Files written into the plan directory (``N`` = pack size)::

    training_<N>.idx.parquet   one row per pack: input_ids list<int32> (the samples' ids, concatenated),
                               loss_mask list<uint8> (each sample's answer mask rolled by one: a mask over labels),
                               seq_start_id list<int32> (start of every sample inside input_ids)
    <N>_metadata.jsonl         a JSON array with one dict: pack_size, max_samples_per_bin,
                               dataset_max_seqlen, min_packed_seqlen, packing_factor, packing_efficiency
                               (+ pad_seq_to_mult when the plan's multiple is > 1)

Bridge's packed collate cuts a stored sample ``[a, b)`` into ``tokens = ids[a:b-1]``,
``labels = ids[a+1:b]`` and ``loss_mask = loss_mask[a:b-1]``, so, as Bridge's own packer does, a
sample's stored mask is its answer mask rolled by one (``stored[i] = answer_mask[i + 1]``, last 0):
Bridge then trains exactly our THD ``loss_mask = answer_mask[1:]``.

Bridge takes each stored sample's length minus 1 as its THD length, which it must be able to cut
into 2*CP chunks: with a plan pad multiple ``m > 1`` (CP > 1, or sequence parallelism) every
sample of ``n`` ids is stored pre-padded, as Bridge's own packer does, to
``ceil((n - 1) / m) * m + 1`` entries with the plan's ``eos_id`` (loss mask 0), and
``dataset_max_seqlen`` counts padded lengths. The padding is eos, not ``pad_id``, because Bridge
ends a pre-padded sample's real length after its last token that is not eos. With ``m = 1``
samples are stored unpadded.

Example: samples ``[A, B, eos]`` (answer mask ``[0, 1, 1]``) and ``[C, eos]`` (``[0, 1]``) become
``input_ids [A, B, eos, C, eos]``, ``loss_mask [1, 1, 0, 1, 0]``, ``seq_start_id [0, 3]``; with
``m = 4``: ``input_ids [A, B, eos, eos, eos, C, eos, eos, eos, eos]``, ``loss_mask [1, 1, 0, 0, 0, 1, 0, 0, 0, 0]``,
``seq_start_id [0, 5]`` (THD lengths 4 and 4, real lengths 2 and 1).

Split and wrapped plans (``packing.on_overflow=split``, ``packing.algorithm=wrapped`` with
``wrapped_attention=document``) pack pieces: each piece is stored as a sample of its own, its
ids ``ids[start:start + n]`` and its own mask (a split piece's repeated overlap targets 0), so
Bridge trains each piece as our THD batch does. Example, ids ``[bos, a, b, c, d, e, eos]``
(answer mask ``[0, 0, 1, 1, 1, 1, 1]``) split at 4 positions with overlap 1: piece 0 ``[bos, a,
b, c, d]`` mask ``[0, 1, 1, 1, 0]``, piece 1 ``[c, d, e, eos]`` mask ``[0, 1, 1, 0]`` (target d
is trained once, in piece 0). Two cases have no faithful form, so they are refused:

* ``wrapped_attention=cross``: a row is one attention sequence of several documents, but a
  Bridge sample's labels are its own ids shifted by one, so a document's last position would
  predict the next document's first token instead of its eos (``validate()`` refuses it).
* with ``m > 1``, a stored sample whose last input is eos (a piece cut right after an eos inside
  a document): Bridge would end its real length before that eos. ``export_bridge`` raises
  ``DataError`` naming the piece.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.packing.split import piece_loss_mask
from megatron_pack.data.store.atomic import read_json
from megatron_pack.data.store.token_store import TokenStore

BRIDGE_FIELDS = ("pack_size", "max_samples_per_bin", "dataset_max_seqlen", "min_packed_seqlen", "packing_factor",
                 "packing_efficiency")
ROWS_PER_GROUP = 1000


def stored_length(num_ids: int, multiple: int) -> int:
    """Entries a sample of ``num_ids`` ids takes in the export: its THD length padded to ``multiple``, plus 1."""
    return -(-(num_ids - 1) // multiple) * multiple + 1 if multiple > 1 else num_ids


def _pack_rows(store: TokenStore, plan: dict, lo: int, hi: int, multiple: int, eos_id: int, overlap: int,
               short: list):
    """Rows ``lo:hi`` of the export; appends ``(pack, entry, sample, piece)`` of every entry Bridge
    would read short (its last input is eos with ``multiple > 1``) to ``short``."""
    offsets = plan["offsets"]
    first, last = int(offsets[lo]), int(offsets[hi])
    # this row group's entries as lists (one slice of each memory-mapped array, not one read per entry)
    order, num_ids = plan["order"][first:last].tolist(), plan["num_ids"][first:last].tolist()
    starts, pieces = ([0] * (last - first) if plan[k] is None else plan[k][first:last].tolist()
                      for k in ("starts", "pieces"))
    ids_col, mask_col, start_col = [], [], []
    for b in range(lo, hi):
        ids, mask, row_starts, pos = [], [], [], 0
        for k in range(int(offsets[b]) - first, int(offsets[b + 1]) - first):
            s, n, piece = order[k], num_ids[k], pieces[k]
            begin = int(store.offsets[s]) + starts[k]
            num_pad = stored_length(n, multiple) - n
            sample_ids = store.tokens[begin:begin + n]
            if multiple > 1 and sample_ids[n - 2] == eos_id:
                short.append((b, k + first - int(offsets[b]), s, piece))
            ids.append(sample_ids)
            # rolled by one: Bridge reads loss_mask[a:b-1] as the mask over labels ids[a+1:b]
            mask.append(piece_loss_mask(store.answer_mask[begin:begin + n], piece, overlap)[1:])
            mask.append(np.zeros(1 + num_pad, dtype=np.uint8))
            if num_pad:
                ids.append(np.full(num_pad, eos_id, dtype=np.int64))
            row_starts.append(pos)
            pos += n + num_pad
        ids_col.append(np.concatenate(ids).astype(np.int32))
        mask_col.append(np.concatenate(mask).astype(np.uint8))
        start_col.append(np.array(row_starts, dtype=np.int32))
    return ids_col, mask_col, start_col


def _short_message(short: list, multiple: int, eos_id: int) -> str:
    pack, entry, sample, piece = short[0]
    return (f"packing.export=bridge: {len(short)} packed piece(s) end with eos (id {eos_id}) as their last input "
            f"(first: pack {pack}, entry {entry}, store sample {sample}, piece {piece}), and Megatron-Bridge with "
            f"pad_seq_to_mult={multiple} ends a sample's real length at its last input that is not eos, so it "
            "would read them short; set packing.export=none, or prepare with a pad multiple of 1 "
            "(parallel.context_parallel_size=1 without sequence parallelism).")


def bridge_metadata(meta: dict) -> dict:
    """The dict Bridge reads from ``<N>_metadata.jsonl``, from our plan metadata.

    With a pad multiple ``m > 1`` the samples are stored pre-padded, so ``dataset_max_seqlen``
    (Bridge's bound on a sub-sequence, its ``max_seqlen`` with ``pad_cu_seqlens``) is rounded up
    to ``m`` and ``pad_seq_to_mult`` records ``m``; with ``m = 1`` the dict is the six fields.
    """
    out = {k: meta[k] for k in BRIDGE_FIELDS}
    multiple = int(meta.get("pad_seq_to_mult", 1))
    if multiple > 1:
        out["dataset_max_seqlen"] = -(-int(out["dataset_max_seqlen"]) // multiple) * multiple
        out["pad_seq_to_mult"] = multiple
    return out


def _read_plan(plan_dir: Path, meta: dict) -> dict:
    load = lambda name: np.load(plan_dir / f"{name}.npy", mmap_mode="r", allow_pickle=False)  # noqa: E731
    files = meta.get("files", {})
    return {"order": load("sample_order"), "num_ids": load("sample_num_ids"),
            "offsets": np.load(plan_dir / "bin_offsets.npy", allow_pickle=False),
            "starts": load("sample_start") if "sample_start.npy" in files else None,
            "pieces": load("sample_piece") if "sample_piece.npy" in files else None}


def bridge_paths(plan_dir: Path, pack_size: int) -> tuple[Path, Path]:
    """Where ``export_bridge`` writes: ``(<plan>/training_<pack>.idx.parquet, <plan>/<pack>_metadata.jsonl)``."""
    return Path(plan_dir) / f"training_{pack_size}.idx.parquet", Path(plan_dir) / f"{pack_size}_metadata.jsonl"


def export_bridge(store: TokenStore, plan_dir: Path) -> tuple[Path, Path]:
    """Write the Bridge parquet and metadata beside the plan; return their paths.

    Raises ``DataError`` for a ``wrapped_attention=cross`` plan, and (writing nothing) when a
    stored sample would be read short (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    plan_dir = Path(plan_dir)
    meta = read_json(plan_dir / "metadata.json")
    if meta.get("images"):  # the plan of a store with images (plan_metadata copies its summary)
        raise DataError(f"packing.export=bridge writes Megatron-Bridge's packed text format, which has no place for "
                        f"the {meta['images']['num_images']} images of {plan_dir.parent.parent}; unset packing.export "
                        "(train reads the images from the token store) or prepare a text-only dataset for Bridge.")
    if meta.get("wrapped_attention") == "cross":
        raise DataError("packing.export=bridge cannot carry packing.wrapped_attention=cross rows: a row is one "
                        "sequence of several documents, which Bridge would train to predict the next document's "
                        "first token; set packing.wrapped_attention=document or packing.export=none.")
    n, multiple, eos_id = meta["pack_size"], int(meta.get("pad_seq_to_mult", 1)), int(meta["eos_id"])
    parquet_path, meta_path = bridge_paths(plan_dir, n)
    plan = _read_plan(plan_dir, meta)
    num_packs, overlap = len(plan["offsets"]) - 1, int(meta.get("split_overlap", 0))
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
                        ("seq_start_id", pa.list_(pa.int32()))])
    tmp, short = plan_dir / f".{parquet_path.name}.tmp", []
    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for lo in range(0, num_packs, ROWS_PER_GROUP):
            cols = _pack_rows(store, plan, lo, min(lo + ROWS_PER_GROUP, num_packs), multiple, eos_id, overlap, short)
            writer.write_table(pa.table([pa.array(c, type=t.type) for c, t in zip(cols, schema)], schema=schema))
    if short:
        tmp.unlink()
        raise DataError(_short_message(short, multiple, eos_id))
    tmp.replace(parquet_path)
    tmp_meta = plan_dir / f".{meta_path.name}.tmp"
    tmp_meta.write_text(json.dumps([bridge_metadata(meta)]) + "\n", encoding="utf-8")
    tmp_meta.replace(meta_path)
    return parquet_path, meta_path
