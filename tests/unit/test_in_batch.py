"""pack_batch_sequences: the issue's cases, length sources, empty rows, and agreement with CP slicing."""

from __future__ import annotations

import contextlib
import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.data.batches.in_batch import IGNORE_INDEX, pack_batch_sequences
from megatron_pack.data.batches.thd import THD_KEYS
from megatron_pack.parallel.cp import pad_multiple, slice_thd_batch
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
