"""Mixing sources by weight or token budget: shares within one pack of target, reproducible by
seed, every pack records its samples' sources, and the accounting counts what mixing leaves out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config import Config, DataConfig, ModelConfig, PackingConfig
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.batches.thd import make_collate_fn
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.packing.mixing import choose_units, mix_selection
from megatron_pack.data.packing.plan import Selection
from megatron_pack.data.prepare import prepare
from megatron_pack.training.breakdown import per_source_loss, source_metrics

PACK = 64


def test_module_example_by_hand():
    kept = np.arange(6)
    sel = Selection(kept, np.full(6, 11, np.int32), {"no_answer_tokens": 0}, 0)
    mixed, source, stats = mix_selection(sel, np.array([0, 0, 0, 0, 1, 1]), ["a", "b"], "weight", [0.5, 0.5], 0, 64)
    assert [s["target_tokens"] for s in stats] == [30, 30] and [s["achieved_tokens"] for s in stats] == [30, 30]
    assert stats[0]["num_samples_selected"] == 3 and stats[1]["num_repeats"] == 1
    assert mixed.dropped["not_selected_by_mixture"] == 1 and len(mixed.kept) == 6
    assert source.tolist().count(1) == 3


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, PACK), min_size=1, max_size=60), st.floats(1, 5000), st.integers(0, 5))
def test_choose_units_within_one_sample_of_target(tokens, target, seed):
    tokens = np.array(tokens)
    picked = choose_units(tokens, target, np.random.default_rng(seed))
    assert abs(tokens[picked].sum() - target) <= tokens.max() / 2 + 0.5 or picked.size <= 1
    assert abs(tokens[picked].sum() - target) <= PACK  # within one pack
    counts = np.bincount(picked, minlength=len(tokens))
    assert counts.max() - counts.min() <= 1 or counts.max() <= int(np.ceil(target / tokens.sum())) + 1


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _records(n, seed, char):
    rng = np.random.default_rng(seed)
    return [{"prompt": "q" * int(rng.integers(1, 10)), "completion": char * int(rng.integers(5, 50))} for _ in range(n)]


def _mixed(tmp_path, weights=(0.6, 0.3, 0.1), seed=0, sizes=(100, 150, 200), **packing):
    inputs = [_write(tmp_path / f"{c}.jsonl", _records(n, i, c)) for i, (c, n) in enumerate(zip("abc", sizes))]
    sources = [{"name": f"src_{c}", "input": p, "weight": w} for c, p, w in zip("abc", inputs, weights)]
    cfg = Config(data=DataConfig(source="files", sources=sources, dataset_dir=str(tmp_path / "ds"), tokenize_workers=1),
                 packing=PackingConfig(packed_sequence_size=PACK, seed=seed, **packing), model=ModelConfig(seq_length=PACK))
    return cfg, PackedSFTDataset(cfg.data.dataset_dir, prepare(cfg, progress=False))


def test_three_sources_60_30_10_within_one_pack(tmp_path):
    cfg, ds = _mixed(tmp_path)
    mixture = ds.metadata["mixture"]["per_source"]
    assert [m["name"] for m in mixture] == ["src_a", "src_b", "src_c"] == ds.source_names
    achieved = np.zeros(3)
    for i in range(len(ds)):
        for s in ds[i]:
            achieved[s["source"]] += len(s["input_ids"]) - 1  # measured from the packs, not the metadata
    assert achieved.tolist() == [m["achieved_tokens"] for m in mixture]
    for m, w in zip(mixture, (0.6, 0.3, 0.1)):
        assert abs(m["achieved_tokens"] - m["target_tokens"]) <= PACK and m["within_one_pack"]
        assert abs(m["target_share"] - w) < 1e-6
    total = achieved.sum()
    assert all(abs(a / total - w) <= PACK / total + 1e-9 for a, w in zip(achieved, (0.6, 0.3, 0.1)))
    assert mixture[0]["num_repeats"] > 0  # the small source was up-sampled
    assert ds.metadata["accounting"]["num_samples_dropped"]["not_selected_by_mixture"] > 0  # the big one down
    acc = ds.metadata["accounting"]
    assert acc["num_samples_read"] == 450 == acc["num_samples_packed"] + sum(acc["num_samples_dropped"].values())
    report = json.loads((ds.plan_dir / "report.json").read_text())
    assert report["mixture"]["per_source"] == mixture


def test_mixing_is_reproducible_by_seed(tmp_path):
    def packs(seed, sub):
        (tmp_path / sub).mkdir()
        _, ds = _mixed(tmp_path / sub, seed=seed)
        return [[(s["sample_id"], s["source"]) for s in ds[i]] for i in range(len(ds))]
    first = packs(0, "a")
    assert first == packs(0, "b") and len(first) > 5
    assert first != packs(1, "c")


def test_token_budget_and_per_source_schema(tmp_path):
    _write(tmp_path / "share.jsonl", [{"conversations": [{"from": "human", "value": "hi"},
                                                         {"from": "gpt", "value": "x" * 20}]}] * 30)
    _write(tmp_path / "pc.jsonl", _records(40, 0, "y"))
    sources = [{"name": "chat", "input": str(tmp_path / "share.jsonl"), "tokens": 500, "format": "sharegpt"},
               {"name": "pc", "input": str(tmp_path / "pc.jsonl"), "tokens": 2000}]
    cfg = Config(data=DataConfig(source="files", sources=sources, dataset_dir=str(tmp_path / "ds"), tokenize_workers=1),
                 packing=PackingConfig(packed_sequence_size=PACK), model=ModelConfig(seq_length=PACK))
    ds = PackedSFTDataset(cfg.data.dataset_dir, prepare(cfg, progress=False))
    mixture = ds.metadata["mixture"]
    assert mixture["kind"] == "tokens"
    assert [abs(m["achieved_tokens"] - t) <= PACK for m, t in zip(mixture["per_source"], (500, 2000))] == [True, True]
    batch = make_collate_fn(ds.metadata)(ds[0])
    sources = {s["source"] for s in ds[0]}
    assert set(batch["token_source"][0][batch["token_source"][0] >= 0].tolist()) == sources
    assert int((batch["token_source"][0] >= 0).sum()) == int(batch["cu_seqlens"][-1])  # every real token tagged


def test_per_source_loss_by_hand_and_metrics():
    out = per_source_loss(torch_tensor([1.0, 2.0, 4.0, float("inf")]), torch_tensor([1, 1, 1, 0]),
                          torch_tensor([0, 1, 1, -1]), 2)
    assert out.tolist() == [[1.0, 6.0], [1.0, 2.0]]
    loss, share = source_metrics([1.0, 6.0, 0.0, 1.0, 2.0, 0.0], ["a", "b", "c"])
    assert loss == {"a": 1.0, "b": 3.0, "c": None} and share == {"a": 1 / 3, "b": 2 / 3, "c": 0.0}


def torch_tensor(values):
    import torch

    return torch.tensor(values)


@pytest.mark.parametrize("bad,match", [
    ([{"name": "a", "input": "x"}], "needs exactly one of weight"),
    ([{"name": "a", "input": "x", "weight": 1}, {"name": "a", "input": "y", "weight": 1}], "unique"),
    ([{"name": "a", "input": "x", "weight": 1}, {"name": "b", "input": "y", "tokens": 5}], "mixes weight and tokens"),
    ([{"name": "a", "input": "x", "weight": -1}], "must be a positive"),
], ids=["no-weight", "duplicate-name", "mixed-kinds", "negative"])
def test_bad_sources_are_refused(bad, match):
    from megatron_pack.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        DataConfig(source="files", sources=bad)


def test_validation_plan_holds_every_held_out_sample_once_and_an_old_mixed_one_is_refused(tmp_path):
    """The held-out share of a mixed dataset is packed as it is (each sample once, no resampling to the
    training shares); a validation plan written by an older prepare (it carries a ``mixture``) is refused
    with the fix, not evaluated silently."""
    import dataclasses

    from megatron_pack.data.store.metadata import VALIDATION_DIRNAME
    from megatron_pack.data.batches.opening import open_validation

    cfg, ds = _mixed(tmp_path)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, validation_fraction=0.2))
    train = PackedSFTDataset(cfg.data.dataset_dir, prepare(cfg, progress=False))
    val = open_validation(cfg, train)
    held = val.metadata["split"]["num_samples_held_out"]
    ids = np.concatenate([val.sample_ids(i) for i in range(len(val))])
    assert held > 10 and len(ids) == len(set(ids.tolist())) == held  # every held-out sample, once
    assert "mixture" not in val.metadata and "mixture" in train.metadata
    meta_file = Path(val.plan_dir) / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["mixture"] = train.metadata["mixture"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"older prepare.*delete {train.plan_dir}"):
        open_validation(cfg, train)
    assert VALIDATION_DIRNAME in str(val.plan_dir)
