"""Property: every token of every kept sample reaches exactly one rank, once per epoch.

Hypothesis draws a mix of sample lengths (some longer than the pack), a pack size, a packing
algorithm and seed, an overflow policy, ``pad_to_max_length`` (with or without fixed-length
cu_seqlens), and a layout (DP, CP, TP, SP).
Each example runs the real path: a JSONL file -> token store (``ensure_store``) -> packing plan
(``ensure_plan``) -> ``PackedSFTDataset`` -> one epoch of ``PackSampler`` per DP rank -> the
training collate (``make_collate_fn``) -> ``slice_thd_batch`` per CP rank -> the sequence-parallel
split per TP rank (contiguous, as megatron-core scatters the sequence dimension) when SP is on;
without SP every TP rank holds its CP rank's tokens (a replica, counted once).

A tag ``sample_id * 2**20 + position`` rides through ``slice_thd_batch`` in place of the labels,
so the check sees exactly what the code path did. Checked per example:

* accounting: read = packed + dropped by reason; the plan packs each kept sample once;
* every (sample, position) of every sample in the epoch's dealt packs lands on exactly one data
  shard (dp, cp[, tp with SP]), exactly once, with its own token, label and loss-mask value;
  padding never carries a target;
* packs not dealt in the epoch are exactly ``num_packs % dp`` (PackSampler's drop_last; the
  training entry reports this count at start), so with ``num_packs % dp == 0`` every token of
  every kept sample is trained once per epoch.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TAG = 2**20
LAYOUTS = [(cp, tp, sp) for cp in (1, 2, 4) for tp in (1, 2, 4) for sp in (False, True) if not (sp and tp == 1)]


@st.composite
def scenarios(draw):
    cp, tp, sp = draw(st.sampled_from(LAYOUTS))
    from megatron_pack.config.layout import pad_multiple

    multiple = pad_multiple(cp, tp, sp)
    pack_size = multiple * draw(st.integers(max(1, 24 // multiple), max(2, 160 // multiple)))
    lengths = draw(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 90)), min_size=3, max_size=40))
    lengths = [(p, c) if p + c else (1, 0) for p, c in lengths]  # an empty sample is an error, tested elsewhere
    lengths = [(2, 3), (4, 1)] + lengths  # something always fits, so the plan is never empty (that is an error)
    return {"cp": cp, "tp": tp, "sp": sp, "dp": draw(st.integers(1, 3)), "pack_size": pack_size,
            "lengths": lengths, "algorithm": draw(st.sampled_from(["bfd", "ffd", "first_fit_shuffle", "sequential"])),
            "plan_seed": draw(st.integers(0, 5)), "train_seed": draw(st.integers(0, 5)),
            "on_overflow": draw(st.sampled_from(["drop", "truncate"])), "pad_to_max_length": draw(st.booleans()),
            "pad_cu_seqlens": draw(st.booleans()),  # used only with pad_to_max_length (the config requires it)
            "chat_every": draw(st.integers(2, 5))}


def _write_input(path: Path, lengths: list[tuple[int, int]], chat_every: int) -> None:
    lines = []
    for i, (num_prompt, num_completion) in enumerate(lengths):
        prompt, completion = "p" * num_prompt, "".join(chr(97 + (i + k) % 26) for k in range(num_completion))
        if i % chat_every == 0 and num_prompt and num_completion:  # an empty turn is a bad record (test_bad_records)
            record = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]}
        else:
            record = {"prompt": prompt, "completion": completion}
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _prepare(tmp: Path, s: dict):
    from megatron_pack.config import Config, DataConfig, ModelConfig, PackingConfig, ParallelConfig
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.prepare import ensure_plan, ensure_store
    from megatron_pack.data.store.manifest import build_manifest
    from megatron_pack.data.store.metadata import plan_settings

    _write_input(tmp / "train.jsonl", s["lengths"], s["chat_every"])
    cfg = Config(model=ModelConfig(seq_length=s["pack_size"]),
                 data=DataConfig(source="files", input=str(tmp / "train.jsonl"), dataset_dir=str(tmp / "ds"),
                                 tokenize_workers=1),
                 packing=PackingConfig(packed_sequence_size=s["pack_size"], algorithm=s["algorithm"],
                                       seed=s["plan_seed"], on_overflow=s["on_overflow"]),
                 parallel=ParallelConfig(context_parallel_size=s["cp"], tensor_model_parallel_size=s["tp"],
                                         sequence_parallel=s["sp"]))
    plan_dir = ensure_plan(ensure_store(cfg, progress=False), plan_settings(cfg), build_manifest(cfg))
    return PackedSFTDataset(tmp / "ds", plan_dir)


def _check_accounting(ds, num_records: int) -> np.ndarray:
    acc = ds.metadata["accounting"]
    assert acc["num_samples_read"] == num_records
    assert acc["num_samples_read"] == acc["num_samples_packed"] + sum(acc["num_samples_dropped"].values())
    order = np.asarray(ds.sample_order)
    assert len(order) == len(set(order.tolist())) == acc["num_samples_packed"]  # each kept sample in one pack
    return order


def _tagged(batch: dict) -> dict:
    """The batch with its labels replaced by ``sample_id * TAG + position`` (-1 on padding)."""
    real = (batch["cu_seqlens"][1:] - batch["cu_seqlens"][:-1]).tolist()
    starts = batch["cu_seqlens_padded"][:-1].tolist()
    tags = torch.full_like(batch["labels"], -1)
    for sample_id, start, length in zip(batch["sample_ids"].tolist(), starts, real):
        tags[0, start:start + length] = sample_id * TAG + torch.arange(length)
    return {**batch, "labels": tags}


def _shards(batch: dict, s: dict):
    """((cp, tp), local batch) for every data shard of one pack: CP slice, then the SP split."""
    from megatron_pack.parallel.cp import slice_thd_batch

    tagged = _tagged(batch)
    for cp_rank in range(s["cp"]):
        local = slice_thd_batch(batch, s["cp"], cp_rank)
        local["tag"] = slice_thd_batch(tagged, s["cp"], cp_rank)["labels"]
        if not (s["sp"] and s["tp"] > 1):
            yield (cp_rank, 0), local
            continue
        width = local["tokens"].shape[1]
        assert width % s["tp"] == 0, "the pad multiple must make every CP shard divisible by TP under SP"
        n = width // s["tp"]
        for tp_rank in range(s["tp"]):
            yield (cp_rank, tp_rank), {k: local[k][:, tp_rank * n:(tp_rank + 1) * n]
                                       for k in ("tokens", "labels", "loss_mask", "tag")}


def _check_values(local: dict, store, take: dict[int, int]) -> None:
    """Each tagged position holds its sample's own token, label and loss-mask value."""
    tag = local["tag"].reshape(-1)
    real = tag >= 0
    assert float(local["loss_mask"].reshape(-1)[~real].sum()) == 0  # padding never carries a target
    for t, token, label, mask in zip(tag[real].tolist(), local["tokens"].reshape(-1)[real].tolist(),
                                     local["labels"].reshape(-1)[real].tolist(),
                                     local["loss_mask"].reshape(-1)[real].tolist()):
        sample_id, position = divmod(t, TAG)
        ids, answer = store.sample(sample_id)
        assert position + 1 < take[sample_id]
        assert (token, label, mask) == (int(ids[position]), int(ids[position + 1]), float(answer[position + 1]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_kept_token_reaches_exactly_one_rank_once_per_epoch(s):
    from megatron_pack.data.batches.sampler import PackSampler
    from megatron_pack.data.batches.thd import make_collate_fn

    with tempfile.TemporaryDirectory() as tmp:
        ds = _prepare(Path(tmp), s)
        order = _check_accounting(ds, len(s["lengths"]))
        take = dict(zip(order.tolist(), np.asarray(ds.sample_num_ids).tolist()))
        fixed_cu = s["pad_to_max_length"] and s["pad_cu_seqlens"]
        collate = make_collate_fn(ds.metadata, pad_to_max_length=s["pad_to_max_length"], pad_cu_seqlens=fixed_cu)
        if len(ds) < s["dp"]:  # fewer packs than DP ranks: refused clearly, then checked with one rank
            with pytest.raises(ValueError, match="gives every rank nothing"):
                PackSampler(len(ds), dp_rank=0, dp_size=s["dp"], seed=s["train_seed"])
            s = {**s, "dp": 1}
        seen, dealt = Counter(), []
        for dp_rank in range(s["dp"]):
            sampler = PackSampler(len(ds), dp_rank=dp_rank, dp_size=s["dp"], seed=s["train_seed"])
            epoch = iter(sampler)
            for _ in range(sampler.num_packs_per_epoch):
                index = next(epoch)
                dealt.append(index)
                batch = collate(ds[index])
                if s["pad_to_max_length"]:
                    assert batch["tokens"].shape[1] == s["pack_size"]
                if fixed_cu:
                    assert len(batch["cu_seqlens"]) == ds.metadata["max_samples_per_bin"] + 2
                for (cp_rank, tp_rank), local in _shards(batch, s):
                    _check_values(local, ds.store, take)
                    tags = local["tag"].reshape(-1)
                    seen.update((t, (dp_rank, cp_rank, tp_rank)) for t in tags[tags >= 0].tolist())
        assert len(dealt) == len(set(dealt)) == len(ds) - len(ds) % s["dp"]  # each dealt pack once
        trained = [int(i) for p in set(dealt) for i in ds.sample_ids(p)]
        expected = {sid * TAG + pos for sid in trained for pos in range(take[sid] - 1)}
        by_token = Counter(t for t, _ in seen)
        assert set(by_token) == expected and all(n == 1 for n in by_token.values())  # one rank, once
        assert len(seen) == len(expected)
        if len(ds) % s["dp"] == 0:
            assert set(trained) == set(order.tolist())  # the whole kept set, every epoch
        assert len(expected) > 0  # the check ran on real tokens


def test_packs_left_out_per_epoch_are_reported(tmp_path, caplog):
    """The count the property above checks (num_packs % dp) is what the training start reports."""
    from megatron_pack.config import Config
    from megatron_pack.data.batches.loader import build_loader

    s = {"cp": 1, "tp": 1, "sp": False, "pack_size": 64, "lengths": [(20, 20)] * 16, "algorithm": "sequential",
         "plan_seed": 0, "on_overflow": "drop", "chat_every": 4}
    ds = _prepare(tmp_path, s)
    assert len(ds) % 3  # the guard: this dataset does not split over 3 ranks
    for dp_size, expect_warning in ((3, True), (1, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="megatron_pack.train"):
            build_loader(Config(), ds, dp_rank=0, dp_size=dp_size)
        left_out = f"leaves out the last {len(ds) % 3} of its shuffled order"
        assert (left_out in caplog.text) is expect_warning, caplog.text
