"""CP slicing of THD batches: hand-computed tables plus hypothesis properties."""

from __future__ import annotations

import bisect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config.layout import pad_multiple
from megatron_pack.parallel.cp import slice_thd_batch, thd_gather_order, thd_partition_indices, thd_unslice

PAD_MULTIPLE_CASES = [
    ((1, 1, False), 1), ((1, 4, False), 1), ((1, 4, True), 4), ((2, 1, False), 4), ((2, 1, True), 4),
    ((2, 4, False), 4), ((2, 4, True), 8), ((4, 2, True), 8), ((3, 2, True), 6), ((3, 4, True), 12),
    ((8, 4, True), 32), ((8, 1, False), 16),
]


@pytest.mark.parametrize("args,expected", PAD_MULTIPLE_CASES, ids=[f"cp{a[0]}-tp{a[1]}-sp{int(a[2])}"
                                                                  for a, _ in PAD_MULTIPLE_CASES])
def test_pad_multiple(args, expected):
    assert pad_multiple(*args) == expected


@pytest.mark.parametrize("bad", [(0, 1, False), (1, 0, True), (True, 1, False), (1.0, 1, False)],
                         ids=["cp0", "tp0", "cp-bool", "cp-float"])
def test_pad_multiple_rejects(bad):
    with pytest.raises(ValueError, match="positive integer"):
        pad_multiple(*bad)


PARTITION_CASES = [
    ("design-example-r0", [0, 8, 16], 2, 0, [0, 1, 6, 7, 8, 9, 14, 15]),
    ("design-example-r1", [0, 8, 16], 2, 1, [2, 3, 4, 5, 10, 11, 12, 13]),
    ("mixed-chunks-r0", [0, 4, 12], 2, 0, [0, 3, 4, 5, 10, 11]),
    ("mixed-chunks-r1", [0, 4, 12], 2, 1, [1, 2, 6, 7, 8, 9]),
    ("cp4-r0", [0, 8], 4, 0, [0, 7]),
    ("cp4-r1", [0, 8], 4, 1, [1, 6]),
    ("cp4-r3", [0, 8], 4, 3, [3, 4]),
    ("zero-length-tail", [0, 8, 16, 16, 16], 2, 1, [2, 3, 4, 5, 10, 11, 12, 13]),
    ("zero-length-middle", [0, 4, 4, 8], 2, 0, [0, 3, 4, 7]),
    ("cp1-odd-lengths", [0, 3, 8], 1, 0, list(range(8))),
]


@pytest.mark.parametrize("cu,cp,rank,expected", [c[1:] for c in PARTITION_CASES], ids=[c[0] for c in PARTITION_CASES])
def test_partition_indices_table(cu, cp, rank, expected):
    got = thd_partition_indices(torch.tensor(cu, dtype=torch.int32), cp, rank)
    assert got.dtype == torch.int64
    assert got.tolist() == expected


def test_gather_order_and_unslice_roundtrip():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert thd_gather_order(cu, 2).tolist() == [0, 1, 6, 7, 8, 9, 14, 15, 2, 3, 4, 5, 10, 11, 12, 13]
    x = torch.arange(16).reshape(1, 16) * 10
    shards = [x[:, thd_partition_indices(cu, 2, r)] for r in range(2)]
    assert torch.equal(thd_unslice(shards, cu), x)
    hidden = torch.randn(16, 1, 3)  # [T, B, H] along dim 0, as attention sees it
    hidden_shards = [hidden[thd_partition_indices(cu, 2, r)] for r in range(2)]
    assert torch.equal(thd_unslice(hidden_shards, cu, dim=0), hidden)


def _batch(cu_padded, cu_real=None, rows=1):
    num_tokens = cu_padded[-1]
    base = torch.arange(num_tokens, dtype=torch.int64).reshape(1, -1).repeat(rows, 1)
    return {
        "tokens": base + 100, "labels": base + 200, "loss_mask": torch.ones(rows, num_tokens),
        "position_ids": base.clone(), "cu_seqlens": torch.tensor(cu_real or cu_padded, dtype=torch.int32),
        "cu_seqlens_padded": torch.tensor(cu_padded, dtype=torch.int32), "max_seqlen": 8,
        "sample_ids": torch.tensor([3, 9]), "num_real_tokens": num_tokens, "num_pad_tokens": 0,
        "num_target_tokens": num_tokens,
    }


def test_slice_thd_batch_design_example_is_pure():
    batch = _batch([0, 8, 16], [0, 7, 13])
    before = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in batch.items()}
    local = slice_thd_batch(batch, 2, 1)
    assert local is not batch
    assert local["tokens"].tolist() == [[102, 103, 104, 105, 110, 111, 112, 113]]
    assert local["labels"].tolist() == [[202, 203, 204, 205, 210, 211, 212, 213]]
    assert local["position_ids"].tolist() == [[2, 3, 4, 5, 10, 11, 12, 13]]
    assert local["loss_mask"].shape == (1, 8)
    for key in ("cu_seqlens", "cu_seqlens_padded", "sample_ids"):
        assert local[key] is batch[key]
    assert (local["max_seqlen"], local["num_target_tokens"]) == (8, 16)
    for key, value in before.items():  # the input batch is untouched
        assert torch.equal(batch[key], value) if torch.is_tensor(value) else batch[key] == value
    assert slice_thd_batch(batch, 1, 0)["tokens"] is batch["tokens"]


ERROR_CASES = [
    ("two-rows", _batch([0, 8, 16], rows=2), 2, "micro-batch size 1 for context-parallel slicing"),
    ("not-divisible", _batch([0, 6, 16]), 2, "not divisible by 2\\*CP = 4.*pad_seq_to_mult"),
    ("cu-last-not-T", dict(_batch([0, 8, 16]), cu_seqlens_padded=torch.tensor([0, 8, 12], dtype=torch.int32)),
     2, "cu_seqlens_padded\\[-1\\] \\(12\\) != number of tokens T \\(16\\)"),
    ("rank-out-of-range", _batch([0, 8, 16]), 2, None),
]


@pytest.mark.parametrize("batch,cp,pattern", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_slice_thd_batch_errors(batch, cp, pattern):
    rank = 5 if pattern is None else 0
    with pytest.raises(ValueError, match=pattern or "cp_rank"):
        slice_thd_batch(batch, cp, rank)


def _te_reference(cu_seqlens_padded, world_size, rank):
    """Per-token port of Transformer Engine's ``thd_partition_indices_kernel`` (an independent oracle)."""
    cu = [int(c) for c in cu_seqlens_padded]
    cu_s = [c // world_size for c in cu]
    out = []
    for token_id in range(cu[-1] // world_size):
        seq_id = bisect.bisect_right(cu_s, token_id) - 1  # TE's binary_search over cu_seqlens / world_size
        seq_len = cu_s[seq_id + 1] - cu_s[seq_id]
        index = token_id - cu_s[seq_id]
        offset = rank if index < seq_len // 2 else (world_size - 1) * 2 - rank
        out.append(index + cu[seq_id] + seq_len // 2 * offset)
    return out


@st.composite
def _layouts(draw):
    cp = draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([1, 2, 4]))
    sp = draw(st.booleans())
    multiple = pad_multiple(cp, tp, sp)
    real = draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    num_empty_tail = draw(st.integers(0, 3))
    padded = [-(-n // multiple) * multiple for n in real] + [0] * num_empty_tail
    return cp, tp, sp, real, padded


@settings(max_examples=40, deadline=None)
@given(_layouts())
def test_partition_properties(layout):
    cp, tp, sp, real, padded = layout
    cu = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0)
    num_tokens = int(cu[-1])
    parts = [thd_partition_indices(cu, cp, r) for r in range(cp)]
    assert [p.tolist() for p in parts] == [_te_reference(cu, cp, r) for r in range(cp)]
    # union of all ranks is every index exactly once, and all ranks hold equal counts
    assert sorted(torch.cat(parts).tolist()) == list(range(num_tokens))
    assert {p.numel() for p in parts} == {num_tokens // cp}
    # with CP > 1 each rank holds exactly one early and one late chunk of every non-empty sub-sequence
    cu64, chunk = cu.long(), torch.tensor(padded) // (2 * cp)
    for r, part in enumerate(parts if cp > 1 else []):
        seq = torch.searchsorted(cu64[1:], part, right=True)
        which = (part - cu64[:-1][seq]) // chunk[seq]
        early, late = which == r, which == 2 * cp - 1 - r
        assert bool((early | late).all())
        assert torch.equal(torch.bincount(seq[early], minlength=len(padded)), chunk)
        assert torch.equal(torch.bincount(seq[late], minlength=len(padded)), chunk)
    # sequence parallelism can split each rank's share over TP evenly
    if sp and tp > 1:
        assert all(p.numel() % tp == 0 for p in parts)
    # slicing then unslicing restores the batch; position ids restart per sub-sequence
    positions = torch.cat([torch.arange(n) for n in padded]).reshape(1, -1) if num_tokens else torch.zeros(1, 0)
    batch = {"tokens": positions.clone(), "position_ids": positions, "cu_seqlens_padded": cu}
    shards = [slice_thd_batch(batch, cp, r)["position_ids"] for r in range(cp)]
    restored = thd_unslice(shards, cu)
    assert torch.equal(restored, positions)
    starts = [int(c) for c, n in zip(cu[:-1], padded) if n]
    assert all(int(restored[0, s]) == 0 for s in starts) and len(starts) == len(real)
