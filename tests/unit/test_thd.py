"""collate_thd / make_collate_fn: worked examples, boundaries, fixed shapes, properties with CP slicing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.data.batches.thd import THD_KEYS, collate_thd, make_collate_fn
from megatron_pack.config.layout import pad_multiple
from megatron_pack.parallel.cp import slice_thd_batch, thd_gather_order

A, B, C, D, EOS, P = 11, 12, 13, 14, 2, 0


def _sample(ids, mask=None, sample_id=None):
    sample = {"input_ids": list(ids), "loss_mask": list(mask if mask is not None else [1] * len(ids))}
    if sample_id is not None:
        sample["sample_id"] = sample_id
    return sample


SIX = [_sample([A, B, EOS], sample_id=7), _sample([C, D, EOS], sample_id=3)]
EXAMPLE_CASES = [
    ("six-token", dict(pack_size=8), dict(
        tokens=[A, B, C, D], labels=[B, EOS, D, EOS], loss_mask=[1, 1, 1, 1], position_ids=[0, 1, 0, 1],
        cu_seqlens=[0, 2, 4], cu_seqlens_padded=[0, 2, 4], max_seqlen=2, counts=(4, 0, 4))),
    ("six-token-pad4", dict(pack_size=8, pad_multiple=4), dict(
        tokens=[A, B, P, P, C, D, P, P], labels=[B, EOS, P, P, D, EOS, P, P], loss_mask=[1, 1, 0, 0, 1, 1, 0, 0],
        position_ids=[0, 1, 2, 3, 0, 1, 2, 3], cu_seqlens=[0, 2, 4], cu_seqlens_padded=[0, 4, 8], max_seqlen=4,
        counts=(4, 4, 4))),
    ("pad-to-max-length", dict(pack_size=12, pad_multiple=2, pad_to_max_length=True), dict(
        tokens=[A, B, C, D] + [P] * 8, labels=[B, EOS, D, EOS] + [P] * 8, loss_mask=[1] * 4 + [0] * 8,
        position_ids=[0, 1, 0, 1] + list(range(8)), cu_seqlens=[0, 2, 4, 4], cu_seqlens_padded=[0, 2, 4, 12],
        max_seqlen=8, counts=(4, 8, 4))),
    ("fixed-cu-seqlens", dict(pack_size=8, pad_multiple=4, num_cu_seqlens=6), dict(
        tokens=[A, B, P, P, C, D, P, P], labels=[B, EOS, P, P, D, EOS, P, P], loss_mask=[1, 1, 0, 0, 1, 1, 0, 0],
        position_ids=[0, 1, 2, 3, 0, 1, 2, 3], cu_seqlens=[0, 2, 4, 4, 4, 4], cu_seqlens_padded=[0, 4, 8, 8, 8, 8],
        max_seqlen=8, counts=(4, 4, 4))),
    ("pad-id-99", dict(pack_size=8, pad_multiple=4, pad_id=99), dict(
        tokens=[A, B, 99, 99, C, D, 99, 99], labels=[B, EOS, 99, 99, D, EOS, 99, 99],
        loss_mask=[1, 1, 0, 0, 1, 1, 0, 0], position_ids=[0, 1, 2, 3, 0, 1, 2, 3], cu_seqlens=[0, 2, 4],
        cu_seqlens_padded=[0, 4, 8], max_seqlen=4, counts=(4, 4, 4))),
]


@pytest.mark.parametrize("kwargs,expected", [c[1:] for c in EXAMPLE_CASES], ids=[c[0] for c in EXAMPLE_CASES])
def test_collate_worked_examples(kwargs, expected):
    batch = collate_thd(SIX, **kwargs)
    assert tuple(batch) == THD_KEYS
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert batch[key].shape == (1, len(expected[key]))
        assert batch[key].tolist() == [expected[key]], key
    assert batch["tokens"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    for key in ("cu_seqlens", "cu_seqlens_padded"):
        assert batch[key].dtype == torch.int32 and batch[key].tolist() == expected[key], key
    assert type(batch["max_seqlen"]) is int and batch["max_seqlen"] == expected["max_seqlen"]
    assert batch["sample_ids"].dtype == torch.int64 and batch["sample_ids"].tolist() == [7, 3]
    assert (batch["num_real_tokens"], batch["num_pad_tokens"], batch["num_target_tokens"]) == expected["counts"]


def test_answer_mask_is_shifted_with_the_labels():
    # prompt [A, B], answer [C, EOS]: targets are C (label at position 1) and EOS (position 2)
    batch = collate_thd([_sample([A, B, C, EOS], [0, 0, 1, 1])], pack_size=4)
    assert batch["labels"].tolist() == [[B, C, EOS]]
    assert batch["loss_mask"].tolist() == [[0.0, 1.0, 1.0]]
    assert batch["num_target_tokens"] == 2


def test_boundaries_never_come_from_token_values():
    # the eos/pad id appears inside samples; only lengths decide boundaries
    samples = [_sample([EOS, P, EOS, P]), _sample([P, P]), _sample([EOS, EOS, EOS])]
    batch = collate_thd(samples, pack_size=16, pad_id=P, pad_multiple=2)
    assert batch["cu_seqlens"].tolist() == [0, 3, 4, 6]
    assert batch["cu_seqlens_padded"].tolist() == [0, 4, 6, 8]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1]]


def test_no_label_crosses_a_sample():
    rng = np.random.default_rng(0)
    lengths = [5, 2, 9, 1, 4, 7]  # a 1-id sample contributes a zero-length sub-sequence
    samples = [_sample(list(100 * (k + 1) + np.arange(n)), sample_id=k) for k, n in enumerate(lengths)]
    rng.shuffle(samples)
    batch = collate_thd(samples, pack_size=64, pad_multiple=4)
    tokens, labels, mask = batch["tokens"][0], batch["labels"][0], batch["loss_mask"][0]
    cu = batch["cu_seqlens_padded"].tolist()
    owner = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(np.diff(cu)))
    real = mask > 0
    # every target belongs to the same sample as its input token, and is that token's successor
    assert torch.equal(tokens[real] // 100, labels[real] // 100)
    assert torch.equal(labels[real], tokens[real] + 1)
    num_transitions = int((owner[1:] != owner[:-1]).sum())
    assert len(samples) >= 5 and num_transitions >= 4 and int(real.sum()) == sum(n - 1 for n in lengths)


def test_fixed_length_cu_seqlens_keep_shape_across_packs():
    collate = make_collate_fn({"pack_size": 32, "max_samples_per_bin": 4, "dataset_max_seqlen": 9, "pad_id": 0},
                              pad_multiple=4, pad_to_max_length=True, pad_cu_seqlens=True)
    packs = [[_sample([1] * 9)], [_sample([1] * 3), _sample([1] * 5), _sample([1] * 2)],
             [_sample([1] * 4), _sample([1] * 4), _sample([1] * 4), _sample([1] * 4)]]
    shapes = {(tuple(b["tokens"].shape), tuple(b["cu_seqlens"].shape), tuple(b["cu_seqlens_padded"].shape),
               b["max_seqlen"]) for b in map(collate, packs)}
    assert shapes == {((1, 32), (6,), (6,), 32)}
    last = collate(packs[1])
    assert last["cu_seqlens"].tolist() == [0, 2, 6, 7, 7, 7]
    assert last["cu_seqlens_padded"].tolist() == [0, 4, 8, 12, 32, 32]


ERROR_CASES = [
    ("overflow", [_sample([1] * 6), _sample([1] * 6)], dict(pack_size=8, pad_multiple=4),
     r"sample_ids \[-1, -1\] needs 16 tokens.*pad_seq_to_mult=4"),
    ("tail-not-multiple", [_sample([1] * 3)], dict(pack_size=10, pad_multiple=4, pad_to_max_length=True),
     "multiple of 4"),
    ("too-many-sub-sequences", SIX, dict(pack_size=8, num_cu_seqlens=2), "max_samples_per_bin \\+ 2"),
    ("max-seqlen-too-small", SIX, dict(pack_size=8, pad_multiple=4, max_seqlen=2), r"max_seqlen \(2\)"),
    ("mask-length", [{"input_ids": [1, 2, 3], "loss_mask": [1, 1], "sample_id": 5}], dict(pack_size=8),
     "sample_id 5"),
    ("empty-pack", [], dict(pack_size=8), "empty pack"),
    ("non-binary-mask", [_sample([1, 2, 3], [0, 2, 1])], dict(pack_size=8), "other than 0 and 1"),
]


@pytest.mark.parametrize("samples,kwargs,pattern", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_collate_errors(samples, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        collate_thd(samples, **kwargs)


def test_make_collate_fn_defaults_from_metadata():
    collate = make_collate_fn({"pack_size": 16, "pad_seq_to_mult": 4, "pad_id": 9})
    batch = collate([_sample([A, B, EOS]), _sample([C, D, D, EOS])])
    assert batch["tokens"].tolist() == [[A, B, 9, 9, C, D, D, 9]]
    assert batch["cu_seqlens"].tolist() == [0, 2, 5] and batch["cu_seqlens_padded"].tolist() == [0, 4, 8]
    with pytest.raises(ValueError, match="max_samples_per_bin"):
        make_collate_fn({"pack_size": 16}, pad_cu_seqlens=True)


@st.composite
def _packs(draw):
    cp = draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([1, 2, 4]))
    sp = draw(st.booleans())
    num_ids = draw(st.lists(st.integers(1, 30), min_size=1, max_size=6))
    return cp, pad_multiple(cp, tp, sp), num_ids, draw(st.booleans())


@settings(max_examples=30, deadline=None)
@given(_packs())
def test_collate_then_slice_properties(pack):
    cp, multiple, num_ids, to_max = pack
    samples = [_sample(list(1000 * (k + 1) + np.arange(n)), list(np.arange(n) % 2), k) for k, n in enumerate(num_ids)]
    padded = [-(-(n - 1) // multiple) * multiple for n in num_ids]
    pack_size = sum(padded) + multiple * 3
    batch = collate_thd(samples, pack_size=pack_size, pad_multiple=multiple, pad_to_max_length=to_max)
    num_tokens = batch["tokens"].shape[1]
    assert num_tokens == (pack_size if to_max else sum(padded)) == int(batch["cu_seqlens_padded"][-1])
    assert batch["num_real_tokens"] + batch["num_pad_tokens"] == num_tokens
    assert batch["num_target_tokens"] == int(batch["loss_mask"].sum())
    # position ids restart at 0 for every sub-sequence and count up through its padding
    cu = batch["cu_seqlens_padded"].tolist()
    expected_pos = [j for a, b in zip(cu[:-1], cu[1:]) for j in range(b - a)]
    assert batch["position_ids"][0].tolist() == expected_pos
    # every rank gets T/CP tokens and every real token lands on exactly one rank
    shards = [slice_thd_batch(batch, cp, r) for r in range(cp)]
    assert {s["tokens"].shape[1] for s in shards} == {num_tokens // cp}
    inverse = torch.argsort(thd_gather_order(batch["cu_seqlens_padded"], cp))
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(torch.cat([s[key] for s in shards], dim=1)[:, inverse], batch[key])
    real_tokens = torch.cat([s["tokens"][s["tokens"] >= 1000] for s in shards])
    assert sorted(real_tokens.tolist()) == sorted(1000 * (k + 1) + j for k, n in enumerate(num_ids) for j in range(n - 1))
