"""export=bridge: Megatron-Bridge's packed parquet holds exactly our packs."""

import json

import numpy as np
import pyarrow.parquet as pq

from megatron_pack.config import Config, DataConfig, PackingConfig, ParallelConfig
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.prepare import prepare


def test_bridge_export_matches_packs(tmp_path):
    cfg = Config(data=DataConfig(source="synthetic", synthetic_num_samples=200, dataset_dir=str(tmp_path / "ds"),
                                 tokenize_workers=1),
                 packing=PackingConfig(packed_sequence_size=256, export="bridge"),
                 parallel=ParallelConfig(context_parallel_size=2))
    plan_dir = prepare(cfg, progress=False)
    ds = PackedSFTDataset(cfg.data.dataset_dir, plan_dir)
    table = pq.read_table(plan_dir / "training_256.idx.parquet")
    assert table.column_names == ["input_ids", "loss_mask", "seq_start_id"]
    assert table.num_rows == len(ds) > 10
    rows = table.to_pylist()
    num_multi = 0
    for i, row in enumerate(rows):
        pack = ds[i]
        assert row["input_ids"] == np.concatenate([s["input_ids"] for s in pack]).tolist()
        assert row["loss_mask"] == np.concatenate([s["loss_mask"] for s in pack]).tolist()
        assert row["seq_start_id"] == np.cumsum([0] + [len(s["input_ids"]) for s in pack[:-1]]).tolist()
        num_multi += len(pack) > 1
    assert num_multi > 5
    meta = json.loads((plan_dir / "256_metadata.jsonl").read_text())
    assert isinstance(meta, list) and len(meta) == 1
    assert meta[0] == {k: ds.metadata[k] for k in ("pack_size", "max_samples_per_bin", "dataset_max_seqlen",
                                                   "min_packed_seqlen", "packing_factor", "packing_efficiency")}
