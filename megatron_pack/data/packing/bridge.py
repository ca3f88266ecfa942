"""Export a plan as Megatron-Bridge's packed parquet, so a Bridge user can train on our packs.

Files written into the plan directory (``N`` = pack size)::

    training_<N>.idx.parquet   one row per pack: input_ids list<int32> (the samples' ids, concatenated,
                               unpadded), loss_mask list<uint8> (answer mask aligned with input_ids),
                               seq_start_id list<int32> (start of every sample inside input_ids)
    <N>_metadata.jsonl         a JSON array with one dict: pack_size, max_samples_per_bin,
                               dataset_max_seqlen, min_packed_seqlen, packing_factor, packing_efficiency

Example: a pack of samples ``[A, B, eos]`` and ``[C, eos]`` becomes ``input_ids [A, B, eos, C, eos]``,
``seq_start_id [0, 3]``.
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


def _pack_rows(store: TokenStore, order, num_ids, offsets, lo: int, hi: int):
    ids_col, mask_col, start_col = [], [], []
    for b in range(lo, hi):
        ids, mask, starts, pos = [], [], [], 0
        for s, n in zip(order[offsets[b]:offsets[b + 1]].tolist(), num_ids[offsets[b]:offsets[b + 1]].tolist()):
            begin = int(store.offsets[s])
            ids.append(store.tokens[begin:begin + n])
            mask.append(store.answer_mask[begin:begin + n])
            starts.append(pos)
            pos += n
        ids_col.append(np.concatenate(ids).astype(np.int32))
        mask_col.append(np.concatenate(mask).astype(np.uint8))
        start_col.append(np.array(starts, dtype=np.int32))
    return ids_col, mask_col, start_col


def export_bridge(store: TokenStore, plan_dir: Path) -> tuple[Path, Path]:
    """Write the Bridge parquet and metadata beside the plan; return their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    plan_dir = Path(plan_dir)
    meta = read_json(plan_dir / "metadata.json")
    n = meta["pack_size"]
    parquet_path, meta_path = plan_dir / f"training_{n}.idx.parquet", plan_dir / f"{n}_metadata.jsonl"
    order = np.load(plan_dir / "sample_order.npy", mmap_mode="r", allow_pickle=False)
    num_ids = np.load(plan_dir / "sample_num_ids.npy", mmap_mode="r", allow_pickle=False)
    offsets = np.load(plan_dir / "bin_offsets.npy", allow_pickle=False)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
                        ("seq_start_id", pa.list_(pa.int32()))])
    tmp = plan_dir / f".{parquet_path.name}.tmp"
    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for lo in range(0, len(offsets) - 1, ROWS_PER_GROUP):
            cols = _pack_rows(store, order, num_ids, offsets, lo, min(lo + ROWS_PER_GROUP, len(offsets) - 1))
            writer.write_table(pa.table([pa.array(c, type=t.type) for c, t in zip(cols, schema)], schema=schema))
    tmp.replace(parquet_path)
    tmp_meta = plan_dir / f".{meta_path.name}.tmp"
    tmp_meta.write_text(json.dumps([{k: meta[k] for k in BRIDGE_FIELDS}]) + "\n", encoding="utf-8")
    tmp_meta.replace(meta_path)
    return parquet_path, meta_path
