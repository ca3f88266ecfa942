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
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_pack.data.store.atomic import read_json
from megatron_pack.data.store.token_store import TokenStore

BRIDGE_FIELDS = ("pack_size", "max_samples_per_bin", "dataset_max_seqlen", "min_packed_seqlen", "packing_factor",
                 "packing_efficiency")
ROWS_PER_GROUP = 1000


def stored_length(num_ids: int, multiple: int) -> int:
    """Entries a sample of ``num_ids`` ids takes in the export: its THD length padded to ``multiple``, plus 1."""
    return -(-(num_ids - 1) // multiple) * multiple + 1 if multiple > 1 else num_ids


def _pack_rows(store: TokenStore, order, num_ids, offsets, lo: int, hi: int, multiple: int, eos_id: int):
    ids_col, mask_col, start_col = [], [], []
    for b in range(lo, hi):
        ids, mask, starts, pos = [], [], [], 0
        for s, n in zip(order[offsets[b]:offsets[b + 1]].tolist(), num_ids[offsets[b]:offsets[b + 1]].tolist()):
            begin, num_pad = int(store.offsets[s]), stored_length(n, multiple) - n
            ids.append(store.tokens[begin:begin + n])
            # rolled by one: Bridge reads loss_mask[a:b-1] as the mask over labels ids[a+1:b]
            mask.append(store.answer_mask[begin + 1:begin + n])
            mask.append(np.zeros(1 + num_pad, dtype=np.uint8))
            if num_pad:
                ids.append(np.full(num_pad, eos_id, dtype=np.int64))
            starts.append(pos)
            pos += n + num_pad
        ids_col.append(np.concatenate(ids).astype(np.int32))
        mask_col.append(np.concatenate(mask).astype(np.uint8))
        start_col.append(np.array(starts, dtype=np.int32))
    return ids_col, mask_col, start_col


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


def export_bridge(store: TokenStore, plan_dir: Path) -> tuple[Path, Path]:
    """Write the Bridge parquet and metadata beside the plan; return their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    plan_dir = Path(plan_dir)
    meta = read_json(plan_dir / "metadata.json")
    n, multiple = meta["pack_size"], int(meta.get("pad_seq_to_mult", 1))
    parquet_path, meta_path = plan_dir / f"training_{n}.idx.parquet", plan_dir / f"{n}_metadata.jsonl"
    order = np.load(plan_dir / "sample_order.npy", mmap_mode="r", allow_pickle=False)
    num_ids = np.load(plan_dir / "sample_num_ids.npy", mmap_mode="r", allow_pickle=False)
    offsets = np.load(plan_dir / "bin_offsets.npy", allow_pickle=False)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
                        ("seq_start_id", pa.list_(pa.int32()))])
    tmp = plan_dir / f".{parquet_path.name}.tmp"
    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for lo in range(0, len(offsets) - 1, ROWS_PER_GROUP):
            cols = _pack_rows(store, order, num_ids, offsets, lo, min(lo + ROWS_PER_GROUP, len(offsets) - 1),
                              multiple, int(meta["eos_id"]))
            writer.write_table(pa.table([pa.array(c, type=t.type) for c, t in zip(cols, schema)], schema=schema))
    tmp.replace(parquet_path)
    tmp_meta = plan_dir / f".{meta_path.name}.tmp"
    tmp_meta.write_text(json.dumps([bridge_metadata(meta)]) + "\n", encoding="utf-8")
    tmp_meta.replace(meta_path)
    return parquet_path, meta_path
