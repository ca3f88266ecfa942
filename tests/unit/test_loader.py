"""data/batches/loader.py: the one place a config becomes a dataset, a collate and a loader."""

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_pack.config import Config, DataConfig, PackingConfig, ParallelConfig
from megatron_pack.data.batches.loader import build_loader, collate_from_config, num_packs_left_out
from megatron_pack.data.batches.opening import open_dataset
from megatron_pack.data.batches.thd import collate_thd
from megatron_pack.data.prepare import prepare

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, **data):
    return Config(data=DataConfig(source="synthetic", synthetic_num_samples=120, dataset_dir=str(tmp_path / "ds"),
                                  tokenize_workers=1, **data),
                  packing=PackingConfig(packed_sequence_size=256),
                  parallel=ParallelConfig(context_parallel_size=2))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("loader"))
    prepare(cfg, progress=False)
    return cfg


# (id, data overrides, packing overrides): the fixed-shape switches the collate must take from the config
CASES = [
    ("plain", {}, {}),
    ("pad_to_max_length", {"pad_to_max_length": True}, {}),
    ("fixed_cu_seqlens", {"pad_to_max_length": True}, {"pad_cu_seqlens": True}),
]


@pytest.mark.parametrize("data,packing", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_collate_from_config_is_collate_thd_with_the_plan_and_the_config(prepared, data, packing):
    cfg = dataclasses.replace(prepared, data=dataclasses.replace(prepared.data, **data),
                              packing=dataclasses.replace(prepared.packing, **packing))
    dataset = open_dataset(cfg)
    meta = dataset.metadata
    collate = collate_from_config(cfg, meta)
    pack = dataset[1]
    got = collate(pack)
    num_cu = meta["max_samples_per_bin"] + 2 if packing.get("pad_cu_seqlens") else None
    want = collate_thd(pack, pack_size=meta["pack_size"], pad_multiple=meta["pad_seq_to_mult"],
                       pad_to_max_length=data.get("pad_to_max_length", False), num_cu_seqlens=num_cu,
                       pad_id=meta["pad_id"], max_seqlen=got["max_seqlen"] if num_cu else None)
    assert meta["pad_seq_to_mult"] == 4  # guard: CP=2 really pads, so a wrong multiple would show
    assert set(got) == set(want)
    for key, value in want.items():
        assert np.array_equal(np.asarray(got[key]), np.asarray(value)), key
    if data.get("pad_to_max_length"):
        assert got["tokens"].shape[-1] == meta["pack_size"]
    if num_cu:
        assert len(got["cu_seqlens"]) == num_cu


@pytest.mark.parametrize("dp_size", [1, 2, 3], ids=["dp1", "dp2", "dp3"])
def test_build_loader_deals_every_pack_once_per_epoch(prepared, dp_size):
    dataset = open_dataset(prepared)
    seen = []
    for dp_rank in range(dp_size):
        loader = build_loader(prepared, dataset, dp_rank=dp_rank, dp_size=dp_size, announce=False)
        per_rank = (len(dataset) - num_packs_left_out(len(dataset), dp_size)) // dp_size
        it = iter(loader)
        for _ in range(per_rank):
            batch = next(it)
            assert isinstance(batch["tokens"], torch.Tensor) and batch["tokens"].shape[0] == 1
            seen.append(tuple(batch["sample_ids"].tolist()))
    packs = {tuple(dataset.sample_ids(i).tolist()) for i in range(len(dataset))}
    assert len(seen) == len(set(seen)) == len(dataset) - num_packs_left_out(len(dataset), dp_size)
    assert set(seen) <= packs


def test_the_collate_is_configured_in_one_place():
    """``make_collate_fn`` is called only by ``collate_from_config``; train and verify go through it (verify by
    ``dataset_collate``, which adds a store's images around it, as the training loader does)."""
    calls = []
    for f in (ROOT / "megatron_pack").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("make_collate_fn"):
                calls.append(str(f.relative_to(ROOT)))
    assert calls == ["megatron_pack/data/batches/loader.py"], calls
    verify = (ROOT / "megatron_pack/cli/verify.py").read_text()
    loop = (ROOT / "megatron_pack/training/loop.py").read_text()
    assert "dataset_collate(" in verify and "loader_lib.build_loader(" in loop
