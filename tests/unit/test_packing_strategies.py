"""Length buckets, split with overlap and the wrapped stream: hand-computed cases, hypothesis
properties (each guarded against passing vacuously) and prepare end to end with the accounting
invariant ``read = packed + dropped`` (pieces counted per sample)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_pack.config import Config, DataConfig, ModelConfig, PackingConfig
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.batches.thd import collate_thd, make_collate_fn
from megatron_pack.data.formats.chat import SampleSchema
from megatron_pack.data.formats.tokenizer import ByteTokenizer
from megatron_pack.data.packing.algorithms import plan_packing, thd_lengths
from megatron_pack.data.packing.buckets import assign_buckets, bucket_boundaries, plan_buckets
from megatron_pack.data.packing.split import piece_loss_mask, split_entries, split_spans
from megatron_pack.data.packing.wrapped import wrapped_entries
from megatron_pack.data.prepare import prepare

BYTE = ByteTokenizer()


# --- seed examples ----------------------------------------------------------------------------

def test_seed_bfd_two_full_rows():
    plan = plan_packing([4, 2, 3, 3], 6)
    assert plan.num_bins == 2 and plan.efficiency == 1.0
    assert sorted(sorted(b.tolist()) for b in plan.bins()) == [[0, 1], [2, 3]]


A, B, C, D, EOS = 10, 11, 12, 13, 2
DOCS = [np.array([A, B, EOS]), np.array([C, D, EOS])]


def _wrapped_rows(docs, capacity, seed=0, multiple=1):
    doc, start, num, piece, offsets = wrapped_entries(np.array([len(d) for d in docs]), capacity, multiple, seed)
    return [[{"input_ids": docs[d][s:s + n], "loss_mask": np.ones(n, np.int64), "sample_id": d, "piece": p}
             for d, s, n, p in zip(doc[lo:hi], start[lo:hi], num[lo:hi], piece[lo:hi])]
            for lo, hi in zip(offsets[:-1], offsets[1:])]


@pytest.mark.parametrize("seed", [0, 1])
def test_seed_wrapped_document_and_cross(seed):
    rows = _wrapped_rows(DOCS, 4, seed)
    assert len(rows) == 1 and [s["sample_id"] for s in rows[0]] in ([0, 1], [1, 0])
    doc = collate_thd(rows[0], pack_size=4)
    first = [A, B] if rows[0][0]["sample_id"] == 0 else [C, D]
    assert doc["tokens"][0, :2].tolist() == first
    assert doc["cu_seqlens"].tolist() == [0, 2, 4] and doc["position_ids"].tolist() == [[0, 1, 0, 1]]
    labels = doc["labels"][0].tolist()
    assert labels[1] == EOS and labels[3] == EOS  # each document's last position predicts its own eos
    metadata = {"pack_size": 4, "pad_seq_to_mult": 1, "wrapped_attention": "cross"}
    cross = make_collate_fn(metadata)(rows[0])
    assert cross["cu_seqlens"].tolist() == [0, 4] and cross["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert cross["labels"].tolist() == doc["labels"].tolist()  # only attention crosses, labels do not
    assert cross["tokens"].tolist() == doc["tokens"].tolist()


def test_wrapped_cuts_a_document_at_the_row_end():
    docs = [np.array([A, B, EOS]), np.array([C, D, 14, EOS])]
    doc, start, num, piece, offsets = wrapped_entries(np.array([3, 4]), 4, 1, seed=0)
    order = np.random.default_rng(0).permutation(2)
    assert doc.tolist()[:2] == order.tolist()
    rows = _wrapped_rows(docs, 4)
    assert sum(int(collate_thd(r, pack_size=4)["cu_seqlens"][-1]) for r in rows) == 5  # 2 + 3 positions
    assert int(collate_thd(rows[0], pack_size=4)["cu_seqlens"][-1]) == 4  # the first row is full
    pieces = [s for r in rows for s in r if s["sample_id"] == 1]
    if len(pieces) == 2:  # the 3-position document crossed the row end
        assert pieces[0]["input_ids"][-1] == pieces[1]["input_ids"][0]  # its last target is the next input
        assert [p["piece"] for p in pieces] == [0, 1]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(2, 40), min_size=1, max_size=40), st.sampled_from([1, 2, 4]),
       st.integers(1, 8), st.integers(0, 3))
def test_wrapped_properties(num_ids, multiple, rows_of, seed):
    capacity = multiple * rows_of * 4
    doc, start, num, piece, offsets = wrapped_entries(np.array(num_ids), capacity, multiple, seed)
    loads = np.add.reduceat(thd_lengths(num, multiple), offsets[:-1])
    assert loads.max() <= capacity and np.all(loads[:-1] == capacity)  # every row but the last is full
    covered = {}
    for d, s, n in zip(doc.tolist(), start.tolist(), num.tolist()):
        covered.setdefault(d, []).extend(range(s + 1, s + n))  # targets of this piece
    assert sorted(covered) == list(range(len(num_ids)))
    for d, targets in covered.items():
        assert targets == list(range(1, num_ids[d]))  # every target once, in order, never another document's
    assert len(num) >= len(num_ids)


# --- split ---------------------------------------------------------------------------------------

SPLIT_CASES = [
    ("module-example", 10, 4, 1, [(0, 5), (3, 5), (6, 4)]),
    ("no-overlap", 10, 4, 0, [(0, 5), (4, 5), (8, 2)]),
    ("fits", 5, 4, 2, [(0, 5)]),
    ("exact-two", 9, 4, 0, [(0, 5), (4, 5)]),
]


@pytest.mark.parametrize("n,max_len,overlap,spans", [c[1:] for c in SPLIT_CASES], ids=[c[0] for c in SPLIT_CASES])
def test_split_spans_by_hand(n, max_len, overlap, spans):
    assert split_spans(n, max_len, overlap) == spans


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 120), st.integers(1, 30), st.data())
def test_split_pieces_cover_every_answer_target_exactly_once(n, max_len, data):
    overlap = data.draw(st.integers(0, max_len - 1))
    mask = np.array(data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), dtype=np.uint8)
    assume(mask[1:].any())
    offsets = np.array([0, n])
    sample, start, num, piece, num_empty = split_entries(np.array([0]), offsets, mask, max_len, overlap)
    trained = []
    for s, k, length in zip(start.tolist(), piece.tolist(), num.tolist()):
        assert length - 1 <= max_len
        piece_mask = piece_loss_mask(mask[s:s + length], k, overlap)
        trained += [s + i for i in range(1, length) if piece_mask[i]]
    assert sorted(trained) == [t for t in range(1, n) if mask[t]]  # once each, none twice, none lost
    assert len(trained) > 0 and len(num) + num_empty == len(split_spans(n, max_len, overlap))


# --- buckets -----------------------------------------------------------------------------------

def test_bucket_example_by_hand():
    lengths = np.array([4, 2, 3, 3, 6, 5])
    bucket_of = assign_buckets(lengths, [4])
    assert bucket_of.tolist() == [0, 0, 0, 0, 1, 1]
    plan, bin_bucket = plan_buckets(lengths, bucket_of, 2, 6, "bfd", 0)
    assert bin_bucket.tolist() == [0, 0, 1, 1]
    assert plan.bin_loads().tolist()[:2] == [6, 6] and sorted(plan.bin_loads().tolist()[2:]) == [5, 6]
    assert bucket_boundaries("auto", np.arange(1, 101)) == [25, 50, 75]
    assert bucket_boundaries(None, lengths) == [] and bucket_boundaries([8, 16], lengths) == [8, 16]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=300),
       st.lists(st.integers(1, 64), min_size=0, max_size=3, unique=True), st.sampled_from(["bfd", "ffd",
                                                                                            "first_fit_shuffle"]))
def test_bucket_properties(lengths, boundaries, algorithm):
    lengths, boundaries = np.array(lengths), sorted(boundaries)
    bucket_of = assign_buckets(lengths, boundaries)
    plan, bin_bucket = plan_buckets(lengths, bucket_of, len(boundaries) + 1, 64, algorithm, 3)
    assert sorted(plan.order.tolist()) == list(range(len(lengths)))  # every sample in exactly one pack
    assert plan.bin_loads().max() <= 64
    for b, members in enumerate(plan.bins()):
        assert set(bucket_of[members].tolist()) == {bin_bucket[b]}  # a pack never mixes buckets
    edges = [0] + boundaries + [10**9]
    for i, length in enumerate(lengths.tolist()):
        assert edges[bucket_of[i]] < length <= edges[bucket_of[i] + 1]
    assert np.all(np.diff(bin_bucket) >= 0) and len(bin_bucket) == plan.num_bins > 0


# --- prepare end to end --------------------------------------------------------------------------

def _records(n=120, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt": "q" * int(rng.integers(1, 30)), "completion": "a" * int(rng.integers(1, 140))}
            for _ in range(n)]


def _prepare(tmp_path, records, data=None, **packing):
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = Config(data=DataConfig(source="files", input=str(tmp_path / "t.jsonl"), dataset_dir=str(tmp_path / "ds"),
                                 tokenize_workers=1, **(data or {})),
                 packing=PackingConfig(packed_sequence_size=64, **packing), model=ModelConfig(seq_length=64))
    return cfg, PackedSFTDataset(cfg.data.dataset_dir, prepare(cfg, progress=False))


def _check_accounting(ds, num_read):
    acc = ds.metadata["accounting"]
    assert acc["num_samples_read"] == num_read == acc["num_samples_packed"] + sum(acc["num_samples_dropped"].values())
    packed = {s["sample_id"] for i in range(len(ds)) for s in ds[i]}
    assert len(packed) == acc["num_samples_packed"]
    return acc


@pytest.mark.parametrize("overlap", [0, 8], ids=["overlap0", "overlap8"])
def test_split_prepare_reassembles_every_answer_token(tmp_path, overlap):
    records = _records()
    cfg, ds = _prepare(tmp_path, records, on_overflow="split", split_overlap=overlap)
    acc = _check_accounting(ds, len(records))
    assert acc["num_samples_split"] > 10 and acc["num_packed_entries"] > len(records)
    trained: dict[int, list] = {}
    for i in range(len(ds)):
        batch = collate_thd(ds[i], pack_size=64)
        assert int(batch["cu_seqlens_padded"][-1]) <= 64
        for s in ds[i]:
            mask = s["loss_mask"]
            trained.setdefault(s["sample_id"], []).append((s["piece"], s["input_ids"][1:][mask[1:] == 1].tolist()))
    assert len(trained) == len(records)
    for sid, pieces in trained.items():  # decode and compare: the answer, each token once, pieces in order
        ids, mask = BYTE.encode_sample(records[sid], SampleSchema("auto"))
        assert sorted(p for p, _ in pieces) == list(range(len(pieces)))
        assert [t for _, tokens in sorted(pieces) for t in tokens] == ids[1:][mask[1:] == 1].tolist()
    assert ds.metadata["split_overlap"] == overlap


def test_buckets_prepare_report_and_metadata(tmp_path):
    records = _records()
    cfg, ds = _prepare(tmp_path, records, on_overflow="split", buckets=[24, 48])
    _check_accounting(ds, len(records))
    info = ds.metadata["buckets"]
    assert info["boundaries"] == [24, 48] and len(info["per_bucket"]) == 3
    assert sum(b["num_packs"] for b in info["per_bucket"]) == len(ds)
    assert sum(b["num_tokens"] for b in info["per_bucket"]) == ds.metadata["num_tokens"]
    assert all(b["num_packs"] > 0 and 0 < b["packing_efficiency"] <= 100 for b in info["per_bucket"])
    for i in range(len(ds)):
        b = ds.pack_bucket(i)
        lo, hi = [0, 24, 48, 10**9][b], [0, 24, 48, 10**9][b + 1]
        assert all(lo < len(s["input_ids"]) - 1 <= hi for s in ds[i])
    report = json.loads((ds.plan_dir / "report.json").read_text())
    assert [b["num_packs"] for b in report["buckets"]["per_bucket"]] == [b["num_packs"] for b in info["per_bucket"]]
    batch = make_collate_fn(ds.metadata)(ds[len(ds) - 1])
    assert batch["bucket"] == ds.pack_bucket(len(ds) - 1) == 2


@pytest.mark.parametrize("attention", ["document", "cross"])
def test_wrapped_prepare(tmp_path, attention):
    records = _records(60)
    cfg, ds = _prepare(tmp_path, records, {"answer_only_loss": attention == "document"}, algorithm="wrapped",
                       wrapped_attention=attention)
    _check_accounting(ds, len(records))
    assert ds.metadata["wrapped_attention"] == attention
    collate = make_collate_fn(ds.metadata)
    real = [int(collate(ds[i])["num_real_tokens"]) for i in range(len(ds))]
    assert all(r == 64 for r in real[:-1]) and 0 < real[-1] <= 64
    num_sequences = [len(collate(ds[i])["cu_seqlens"]) - 1 for i in range(len(ds))]
    num_pieces = [len(ds[i]) for i in range(len(ds))]
    assert max(num_pieces) > 1 and len(ds) > 5  # some row holds several documents
    assert num_sequences == ([1] * len(ds) if attention == "cross" else num_pieces)


def test_plan_packing_points_wrapped_to_its_module():
    from megatron_pack.data.packing.algorithms import ALGORITHMS, BIN_PACKING_ALGORITHMS

    assert "wrapped" in ALGORITHMS and "wrapped" not in BIN_PACKING_ALGORITHMS and len(BIN_PACKING_ALGORITHMS) == 4
    with pytest.raises(ValueError, match="wrapped_entries"):
        plan_packing([1, 2], 4, "wrapped")
