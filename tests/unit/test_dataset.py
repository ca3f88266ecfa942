"""PackedSFTDataset: validation (format, checksums, tokenizer), plan lookup from config, item format."""

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_pack.config import Config, DataConfig, PackingConfig, ParallelConfig
from megatron_pack.data.store import metadata as metadata_module
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.prepare import prepare
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.batches.thd import collate_thd

BRIDGE_KEYS = ("pack_size", "max_samples_per_bin", "dataset_max_seqlen", "min_packed_seqlen", "packing_factor",
               "packing_efficiency")


def _cfg(tmp_path, **packing):
    return Config(data=DataConfig(source="synthetic", synthetic_num_samples=300, dataset_dir=str(tmp_path / "ds"),
                                  tokenize_workers=1),
                  packing=PackingConfig(packed_sequence_size=256, **packing),
                  parallel=ParallelConfig(context_parallel_size=2))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("dataset")
    cfg = _cfg(tmp_path)
    return cfg, prepare(cfg, progress=False)


def test_item_format_feeds_collate(prepared):
    cfg, plan_dir = prepared
    ds = PackedSFTDataset.from_config(cfg)
    assert ds.plan_dir == plan_dir and len(ds) == ds.metadata["num_bins"] > 20
    pack = ds[3]
    assert len(pack) >= 1 and set(pack[0]) == {"input_ids", "loss_mask", "sample_id"}
    for s in pack:
        assert s["input_ids"].dtype == np.int64 and s["loss_mask"].shape == s["input_ids"].shape
        assert s["input_ids"][-1] == ds.metadata["eos_id"] and isinstance(s["sample_id"], int)
    batch = collate_thd(pack, pack_size=256, pad_multiple=ds.metadata["pad_seq_to_mult"])
    assert batch["sample_ids"].tolist() == [s["sample_id"] for s in pack]
    assert int(batch["cu_seqlens_padded"][-1]) <= 256
    assert [s["sample_id"] for s in ds[-1]] == [s["sample_id"] for s in ds[len(ds) - 1]]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_metadata_names(prepared):
    cfg, _ = prepared
    meta = PackedSFTDataset.from_config(cfg).metadata
    for key in BRIDGE_KEYS + ("pad_seq_to_mult", "algorithm", "seed", "num_bins", "vocab_size", "tokenizer",
                              "pad_id", "eos_id", "lower_bound_bins", "num_padding_tokens"):
        assert key in meta, key
    assert meta["pad_seq_to_mult"] == 4 and meta["vocab_size"] == 263 and meta["pack_size"] == 256
    assert meta["max_samples_per_bin"] >= meta["packing_factor"] > 1
    assert 0 < meta["min_packed_seqlen"] <= 256 and meta["dataset_max_seqlen"] <= 256


def test_from_config_without_matching_plan(prepared):
    cfg, _ = prepared
    other = _cfg(Path(cfg.data.dataset_dir).parent, seed=7)
    with pytest.raises(DataError, match=r"no packing plan pack256_mult4_bfd_seed7_.*megatron-pack prepare"):
        PackedSFTDataset.from_config(other)
    missing = Config(data=DataConfig(dataset_dir=str(Path(cfg.data.dataset_dir).parent / "nothing")))
    with pytest.raises(DataError, match="holds no prepared dataset.*megatron-pack prepare"):
        PackedSFTDataset.from_config(missing)


def test_refuses_other_tokenizer(prepared):
    cfg, plan_dir = prepared
    identity = json.loads((Path(cfg.data.dataset_dir) / "metadata.json").read_text())["tokenizer"]
    other = {**identity, "name": "llama", "vocab_hash": "f" * 64}
    with pytest.raises(DataError, match="tokenized with tokenizer 'byte'.*training uses 'llama'.*data.tokenizer"):
        PackedSFTDataset(cfg.data.dataset_dir, plan_dir, expected_tokenizer=other)
    PackedSFTDataset(cfg.data.dataset_dir, plan_dir, expected_tokenizer=identity)


def test_several_plans_need_a_choice(tmp_path):
    cfg = _cfg(tmp_path)
    prepare(cfg, progress=False)
    prepare(_cfg(tmp_path, seed=1), progress=False)
    with pytest.raises(DataError, match="has 2 packing plans"):
        PackedSFTDataset(cfg.data.dataset_dir)


@pytest.mark.parametrize("victim,match", [("tokens.npy", "sha256"), ("plans/*/sample_order.npy", "sha256"),
                                          ("offsets.npy", "bytes, metadata says")],
                         ids=["store-bitflip", "plan-bitflip", "store-truncated"])
def test_detects_damage(tmp_path, victim, match):
    cfg = _cfg(tmp_path)
    plan_dir = prepare(cfg, progress=False)
    path = next(Path(cfg.data.dataset_dir).glob(victim))
    data = bytearray(path.read_bytes())
    if match.startswith("bytes"):
        data = data[:-8]
    else:
        data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    metadata_module._VERIFIED.clear()
    with pytest.raises(DataError, match=f"is damaged.*{match}.*re-run `megatron-pack prepare`"):
        PackedSFTDataset(cfg.data.dataset_dir, plan_dir)


def test_checksums_verified_once_per_file_version(prepared, monkeypatch):
    cfg, plan_dir = prepared
    PackedSFTDataset(cfg.data.dataset_dir, plan_dir)
    calls = []
    monkeypatch.setattr(metadata_module, "sha256_file", lambda p: calls.append(p) or "x")
    PackedSFTDataset(cfg.data.dataset_dir, plan_dir)
    assert calls == []  # cached by (path, size, mtime)


def test_state_carries_paths_not_arrays(prepared):
    cfg, plan_dir = prepared
    ds = PackedSFTDataset(cfg.data.dataset_dir, plan_dir)
    state = ds.__getstate__()
    assert set(state) == {"dataset_dir", "plan_dir", "metadata", "store_metadata"}
    clone = PackedSFTDataset.__new__(PackedSFTDataset)
    clone.__setstate__(state)
    assert len(clone) == len(ds) and [s["sample_id"] for s in clone[2]] == [s["sample_id"] for s in ds[2]]
