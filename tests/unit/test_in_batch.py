"""pack_batch_sequences: the issue's cases, length sources, empty rows, and agreement with CP slicing."""

from __future__ import annotations

import contextlib
import json
import itertools
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.data.batches.in_batch import IGNORE_INDEX, pack_batch_sequences
from megatron_pack.data.batches.thd import THD_KEYS
from megatron_pack.config.layout import pad_multiple
from megatron_pack.parallel.cp import slice_thd_batch
from megatron_pack.training.step import get_packed_seq_params

PAD = 0


def _rows(lengths, row_size=6):
    """Right-padded rows: row b holds 10*(b+1) + j at j < lengths[b], PAD after."""
    num_rows = len(lengths)
    j = torch.arange(row_size).expand(num_rows, row_size)
    real = j < torch.tensor(lengths).unsqueeze(1)
    tokens = torch.where(real, 10 * torch.arange(1, num_rows + 1).unsqueeze(1) + j, torch.full_like(j, PAD))
    labels = torch.where(real, tokens + 1, torch.full_like(j, IGNORE_INDEX))
    return tokens, labels, real.float(), torch.where(real, j, torch.zeros_like(j)), real.long()


CASES = [
    ("lengths-3-5", [3, 5], 1, dict(cu_seqlens=[0, 3, 8], cu_seqlens_padded=[0, 3, 8], max_seqlen=5,
                                    tokens=[10, 11, 12, 20, 21, 22, 23, 24], position_ids=[0, 1, 2, 0, 1, 2, 3, 4])),
    ("lengths-3-5-cp2", [3, 5], pad_multiple(2, 1, False), dict(
        cu_seqlens=[0, 3, 8], cu_seqlens_padded=[0, 4, 12], max_seqlen=8,
        tokens=[10, 11, 12, PAD, 20, 21, 22, 23, 24, PAD, PAD, PAD],
        position_ids=[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7])),
    ("empty-middle-row", [2, 0, 4], 2, dict(cu_seqlens=[0, 2, 6], cu_seqlens_padded=[0, 2, 6], max_seqlen=4,
                                            tokens=[10, 11, 30, 31, 32, 33], position_ids=[0, 1, 0, 1, 2, 3])),
    ("full-rows", [6, 6], 4, dict(cu_seqlens=[0, 6, 12], cu_seqlens_padded=[0, 8, 16], max_seqlen=8,
                                  tokens=[10, 11, 12, 13, 14, 15, PAD, PAD, 20, 21, 22, 23, 24, 25, PAD, PAD],
                                  position_ids=[0, 1, 2, 3, 4, 5, 6, 7] * 2)),
]


@pytest.mark.parametrize("source", ["lengths", "attention_mask"])
@pytest.mark.parametrize("lengths,multiple,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_pack_batch_sequences_table(lengths, multiple, expected, source):
    tokens, labels, loss_mask, position_ids, attention_mask = _rows(lengths)
    kwargs = {"lengths": lengths} if source == "lengths" else {"attention_mask": attention_mask}
    with pytest.warns(UserWarning, match="skipping 1 empty row") if 0 in lengths else contextlib.nullcontext():
        out = pack_batch_sequences(tokens, labels, loss_mask, position_ids, pad_token_id=PAD,
                                   pad_to_multiple_of=multiple, **kwargs)
    assert tuple(out) == THD_KEYS
    for key in ("cu_seqlens", "cu_seqlens_padded"):
        assert out[key].dtype == torch.int32 and out[key].tolist() == expected[key]
    assert out["max_seqlen"] == expected["max_seqlen"] and type(out["max_seqlen"]) is int
    assert out["tokens"].tolist() == [expected["tokens"]]
    assert out["position_ids"].tolist() == [expected["position_ids"]]
    real = out["tokens"][0] != PAD
    assert torch.equal(out["labels"][0][real], out["tokens"][0][real] + 1)
    assert (out["labels"][0][~real] == IGNORE_INDEX).all() and (out["loss_mask"][0][~real] == 0).all()
    assert out["num_real_tokens"] == sum(lengths) == out["num_target_tokens"]
    assert out["num_pad_tokens"] == len(expected["tokens"]) - sum(lengths)
    assert out["sample_ids"].tolist() == [b for b, n in enumerate(lengths) if n]


def test_pad_ids_inside_rows_are_kept():
    # token 0 == pad id appears as a real token: lengths, not ids, decide
    tokens = torch.tensor([[5, 0, 0, 0], [0, 7, 0, 0]])
    out = pack_batch_sequences(tokens, tokens, torch.ones(2, 4), None, pad_token_id=0, lengths=[3, 2])
    assert out["tokens"].tolist() == [[5, 0, 0, 0, 7]] and out["cu_seqlens"].tolist() == [0, 3, 5]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]]


def test_in_batch_pack_feeds_cp_slicing_and_packed_seq_params():
    tokens, labels, loss_mask, position_ids, _ = _rows([3, 5, 1])
    out = pack_batch_sequences(tokens, labels, loss_mask, position_ids, pad_token_id=PAD,
                               pad_to_multiple_of=pad_multiple(2, 2, True), lengths=[3, 5, 1])
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 12, 16]
    shards = [slice_thd_batch(out, 2, r) for r in range(2)]
    assert [s["tokens"].shape[1] for s in shards] == [8, 8]
    assert sum(int(s["loss_mask"].sum()) for s in shards) == 9
    params = get_packed_seq_params(out)
    assert params.cu_seqlens_q.tolist() == [0, 3, 8, 9] and params.cu_seqlens_q_padded.tolist() == [0, 4, 12, 16]


ERROR_CASES = [
    ("all-empty", dict(lengths=[0, 0]), "every row .* is empty"),
    ("no-length-source", dict(), "never guessed from pad token ids"),
    ("too-long", dict(lengths=[7, 1]), r"must each be in \[0, S=6\]"),
    ("wrong-count", dict(lengths=[1, 2, 3]), "3 entries for 2 rows"),
    ("left-padded-mask", dict(attention_mask=torch.tensor([[0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])),
     "row 0 is not right-padded"),
    ("bad-multiple", dict(lengths=[1, 1], pad_to_multiple_of=0), "pad_to_multiple_of"),
]


@pytest.mark.parametrize("kwargs,pattern", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_pack_batch_sequences_errors(kwargs, pattern):
    tokens, labels, loss_mask, position_ids, _ = _rows([2, 2])
    with pytest.raises(ValueError, match=pattern):
        pack_batch_sequences(tokens, labels, loss_mask, position_ids, pad_token_id=PAD, **kwargs)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(any), st.sampled_from([1, 2, 4, 8]))
def test_in_batch_properties(lengths, multiple):
    tokens, labels, loss_mask, position_ids, _ = _rows(lengths, row_size=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = pack_batch_sequences(tokens, labels, loss_mask, position_ids, pad_token_id=PAD,
                                   pad_to_multiple_of=multiple, lengths=lengths)
    kept = [n for n in lengths if n]
    padded = [-(-n // multiple) * multiple for n in kept]
    assert out["cu_seqlens"].tolist() == [0] + list(itertools.accumulate(kept))
    assert out["cu_seqlens_padded"].tolist() == [0] + list(itertools.accumulate(padded))
    assert out["max_seqlen"] == max(padded) and out["tokens"].shape == (1, sum(padded))
    # every real token appears once, in row order, and nothing else carries a target
    real = out["loss_mask"][0] > 0
    expected = [10 * (b + 1) + j for b, n in enumerate(lengths) for j in range(n)]
    assert out["tokens"][0][real].tolist() == expected and int(real.sum()) == sum(lengths) > 0


# ---- collate_in_batch: the collate of packing.mode=in_batch (issue 11, "in-batch packing must train") ----

def test_collate_in_batch_hand_computed():
    from megatron_pack.data.batches.in_batch import collate_in_batch

    samples = [{"input_ids": [5, 6, 7, 2], "loss_mask": [0, 1, 1, 1], "sample_id": 40},
               {"input_ids": [8, 9, 10, 11, 12, 2], "loss_mask": [0, 0, 1, 1, 1, 1], "sample_id": 7}]
    b = collate_in_batch(samples, pad_multiple=4, pad_id=0)
    assert b["tokens"].tolist() == [[5, 6, 7, 0, 8, 9, 10, 11, 12, 0, 0, 0]]
    assert b["labels"].tolist() == [[6, 7, 2, 0, 9, 10, 11, 12, 2, 0, 0, 0]]
    assert b["loss_mask"].tolist() == [[1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0]]
    assert b["cu_seqlens"].tolist() == [0, 3, 8] and b["cu_seqlens_padded"].tolist() == [0, 4, 12]
    assert b["max_seqlen"] == 8 and b["sample_ids"].tolist() == [40, 7] and b["num_target_tokens"] == 7


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6), mult=st.sampled_from([1, 2, 4, 8]),
       seed=st.integers(0, 10**6))
def test_collate_in_batch_equals_the_offline_collate_per_sample(lengths, mult, seed):
    """Every sub-sequence (tokens, labels, loss_mask, positions, boundaries) is what collate_thd gives the
    same samples, with a pad id that also occurs inside samples (boundaries never come from token values)."""
    from megatron_pack.config.layout import round_up
    from megatron_pack.data.batches.in_batch import collate_in_batch
    from megatron_pack.data.batches.thd import collate_thd

    rng = np.random.default_rng(seed)
    samples = [{"input_ids": np.append(rng.integers(0, 4, n), 3), "loss_mask": rng.integers(0, 2, n + 1),
                "sample_id": i} for i, n in enumerate(lengths)]  # pad id 0 appears inside the samples
    got = collate_in_batch(samples, pad_multiple=mult, pad_id=0)
    size = sum(round_up(n, mult) for n in lengths)
    ref = collate_thd(samples, pack_size=size, pad_multiple=mult, pad_id=0)
    assert got["tokens"].shape[-1] % mult == 0 and got["cu_seqlens_padded"][-1] == got["tokens"].shape[-1]
    for key in ("tokens", "labels", "loss_mask", "cu_seqlens", "cu_seqlens_padded", "sample_ids"):
        assert torch.equal(got[key].to(ref[key].dtype), ref[key]), key
    real = [torch.arange(c, c + n) for c, n in zip(ref["cu_seqlens_padded"][:-1].tolist(), lengths)]
    idx = torch.cat(real)
    assert torch.equal(got["position_ids"][0, idx], ref["position_ids"][0, idx])
    assert got["num_target_tokens"] == int(sum(int(s["loss_mask"][1:].sum()) for s in samples)) >= 0


def test_micro_batch_dataset_keeps_every_sample_once(tmp_path):
    from megatron_pack.cli.main import main
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.loader import collate_from_config
    from megatron_pack.data.batches.opening import open_dataset

    ds = tmp_path / "ds"
    assert main(["prepare", "data=synthetic", "data.synthetic_num_samples=50", "data.tokenize_workers=1",
                 f"data.dataset_dir={ds}", "packing.packed_sequence_size=256"]) == 0
    cfg = load_config([f"data.dataset_dir={ds}", "packing.mode=in_batch",
                       "train.micro_batch_size=4", "train.global_batch_size=8", "model.seq_length=256",
                       "parallel.context_parallel_size=2"])
    dataset = open_dataset(cfg)
    groups = [dataset.sample_ids(i).tolist() for i in range(len(dataset))]
    assert len(dataset) == 13 and [len(g) for g in groups] == [4] * 12 + [2]  # 50 = 12 * 4 + 2: none left out
    assert sorted(i for g in groups for i in g) == list(range(50))
    batch = collate_from_config(cfg, dataset.metadata)(dataset[0])
    assert batch["sample_ids"].tolist() == groups[0]
    assert all(int(n) % 4 == 0 for n in torch.diff(batch["cu_seqlens_padded"]))  # CP=2 pad multiple


def test_micro_batch_dataset_applies_the_overflow_policy(tmp_path):
    from megatron_pack.cli.main import main
    from megatron_pack.data.batches.micro_batches import MicroBatchDataset
    from megatron_pack.data.formats.sources import DataError

    ds = tmp_path / "ds"
    assert main(["prepare", "data=synthetic", "data.synthetic_num_samples=50", "data.tokenize_workers=1",
                 f"data.dataset_dir={ds}", "packing.packed_sequence_size=256"]) == 0
    longest = int(json.loads((ds / "metadata.json").read_text())["sample_num_ids_percentiles"]["max"]) - 1
    with pytest.raises(DataError, match="model.seq_length"):
        MicroBatchDataset(ds, micro_batch_size=4, max_length=longest - 1)
    kept = MicroBatchDataset(ds, micro_batch_size=4, max_length=longest - 1, on_overflow="truncate")
    assert kept.metadata["accounting"]["num_samples_truncated"] >= 1
    assert max(len(s["input_ids"]) for i in range(len(kept)) for s in kept[i]) - 1 <= longest - 1
