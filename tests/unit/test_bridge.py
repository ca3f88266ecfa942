"""export=bridge: Megatron-Bridge's packed parquet holds exactly our packs, CP-aligned as Bridge reads them.

Bridge's packed collate takes every stored sample's length minus 1 as its (CP-aligned) THD
length. With CP > 1 the export stores each sample pre-padded to the plan's multiple (pad id,
loss mask 0); with CP = 1 it stores the samples as they are, byte for byte what it always wrote.
"""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_pack.config import Config, DataConfig, PackingConfig, ParallelConfig
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.prepare import prepare
from megatron_pack.data.thd import collate_thd

SIX_FIELDS = ("pack_size", "max_samples_per_bin", "dataset_max_seqlen", "min_packed_seqlen", "packing_factor",
              "packing_efficiency")


def _export(tmp_path, cp: int):
    cfg = Config(data=DataConfig(source="synthetic", synthetic_num_samples=200, dataset_dir=str(tmp_path / f"ds{cp}"),
                                 tokenize_workers=1),
                 packing=PackingConfig(packed_sequence_size=256, export="bridge"),
                 parallel=ParallelConfig(context_parallel_size=cp))
    plan_dir = prepare(cfg, progress=False)
    return PackedSFTDataset(cfg.data.dataset_dir, plan_dir), plan_dir


def _bridge_cu_seqlens(row: dict) -> list[int]:
    """cu_seqlens as Megatron-Bridge's GPTSFTPackedDataset.collate_fn builds them: stored length - 1 each."""
    bounds = row["seq_start_id"] + [len(row["input_ids"])]
    return np.cumsum([0] + [bounds[i + 1] - bounds[i] - 1 for i in range(len(bounds) - 1)]).tolist()


def test_cp1_export_is_the_unpadded_samples_byte_for_byte(tmp_path):
    ds, plan_dir = _export(tmp_path, cp=1)
    assert ds.metadata["pad_seq_to_mult"] == 1
    rows = [{"input_ids": np.concatenate([s["input_ids"] for s in pack]).astype(np.int32),
             "loss_mask": np.concatenate([s["loss_mask"] for s in pack]).astype(np.uint8),
             "seq_start_id": np.cumsum([0] + [len(s["input_ids"]) for s in pack[:-1]]).astype(np.int32)}
            for pack in (ds[i] for i in range(len(ds)))]
    assert len(rows) > 10 and sum(len(r["seq_start_id"]) > 1 for r in rows) > 5
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
                        ("seq_start_id", pa.list_(pa.int32()))])
    expected = tmp_path / "expected.parquet"
    with pq.ParquetWriter(expected, schema, compression="zstd") as writer:  # the format as first released
        writer.write_table(pa.table([pa.array([r[k] for r in rows], type=f.type) for k, f in zip(
            ("input_ids", "loss_mask", "seq_start_id"), schema)], schema=schema))
    assert (plan_dir / "training_256.idx.parquet").read_bytes() == expected.read_bytes()
    meta_text = (plan_dir / "256_metadata.jsonl").read_text()
    assert meta_text == json.dumps([{k: ds.metadata[k] for k in SIX_FIELDS}]) + "\n"


@pytest.mark.parametrize("cp", [2, 4], ids=["cp2", "cp4"])
def test_cp_export_stores_samples_prepadded_to_the_plan_multiple(tmp_path, cp):
    ds, plan_dir = _export(tmp_path, cp=cp)
    multiple, pad_id = ds.metadata["pad_seq_to_mult"], ds.metadata["pad_id"]
    assert multiple == 2 * cp
    rows = pq.read_table(plan_dir / "training_256.idx.parquet").to_pylist()
    assert len(rows) == len(ds) > 10
    num_samples = num_padded = 0
    for i, row in enumerate(rows):
        pack = ds[i]
        bounds = row["seq_start_id"] + [len(row["input_ids"])]
        assert len(bounds) == len(pack) + 1 and len(row["loss_mask"]) == len(row["input_ids"]) <= 256 + len(pack)
        for j, sample in enumerate(pack):
            stored_ids = row["input_ids"][bounds[j]:bounds[j + 1]]
            stored_mask = row["loss_mask"][bounds[j]:bounds[j + 1]]
            n = len(sample["input_ids"])
            assert (len(stored_ids) - 1) % multiple == 0, f"pack {i} sample {j}: length {len(stored_ids)}"
            assert len(stored_ids) - 1 - (n - 1) < multiple  # no more padding than needed
            assert stored_ids[:n] == sample["input_ids"].tolist() and stored_mask[:n] == sample["loss_mask"].tolist()
            assert set(stored_ids[n:]) <= {pad_id} and set(stored_mask[n:]) <= {0}
            num_samples += 1
            num_padded += len(stored_ids) > n
        # what Bridge's collate builds is our THD batch's padded boundaries
        ours = collate_thd(pack, pack_size=256, pad_multiple=multiple)["cu_seqlens_padded"].tolist()
        assert _bridge_cu_seqlens(row) == ours
    assert num_padded >= num_samples // 4 > 0  # guard: many samples really needed padding
    meta = json.loads((plan_dir / "256_metadata.jsonl").read_text())
    assert isinstance(meta, list) and len(meta) == 1
    assert meta[0]["pad_seq_to_mult"] == multiple and meta[0]["dataset_max_seqlen"] % multiple == 0
    longest = max(len(r["input_ids"][a:b]) - 1 for r in rows
                  for a, b in zip(r["seq_start_id"], r["seq_start_id"][1:] + [len(r["input_ids"])]))
    assert meta[0]["dataset_max_seqlen"] == longest
    assert {k: meta[0][k] for k in SIX_FIELDS if k != "dataset_max_seqlen"} == {
        k: ds.metadata[k] for k in SIX_FIELDS if k != "dataset_max_seqlen"}
