"""PackSampler / the offline StepLoader: order tables, DP sharding, and resume at the exact next step."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_pack.data.batches.sampler import PackSampler
from megatron_pack.data.packing.order import EpochOrder
from megatron_pack.data.batches.steps import StepLoader, StepPlanner, StepRule
from megatron_pack.data.batches.thd import make_collate_fn


def _take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


ORDER_CASES = [
    # epoch 1's order is rotated by the 1 pack epoch 0 left out: [4, 0, 1, 2, 3]
    ("drop-last-r0", dict(num_packs=5, dp_rank=0, dp_size=2, drop_last=True), [0, 2, 4, 1]),
    ("drop-last-r1", dict(num_packs=5, dp_rank=1, dp_size=2, drop_last=True), [1, 3, 0, 2]),
    ("wrap-r0", dict(num_packs=5, dp_rank=0, dp_size=2, drop_last=False), [0, 2, 4, 0, 2, 4]),
    ("wrap-r1", dict(num_packs=5, dp_rank=1, dp_size=2, drop_last=False), [1, 3, 0, 1, 3, 0]),
    ("single-rank", dict(num_packs=3, dp_rank=0, dp_size=1), [0, 1, 2, 0, 1, 2]),
]


@pytest.mark.parametrize("kwargs,expected", [c[1:] for c in ORDER_CASES], ids=[c[0] for c in ORDER_CASES])
def test_unshuffled_order(kwargs, expected):
    sampler = PackSampler(**kwargs, seed=0, shuffle=False)
    assert _take(sampler, len(expected)) == expected
    assert sampler.num_packs_per_epoch == len(expected) // 2


@pytest.mark.parametrize("num_packs,dp_size", [(5, 2), (23, 3), (10, 4)], ids=["5-over-2", "23-over-3", "10-over-4"])
def test_unshuffled_drop_last_leaves_out_a_different_tail_each_epoch(num_packs, dp_size):
    samplers = [PackSampler(num_packs, dp_rank=r, dp_size=dp_size, seed=0, shuffle=False) for r in range(dp_size)]
    per_epoch = samplers[0].num_packs_per_epoch
    num_epochs = num_packs  # enough rotations for every pack to be left out at most once in a row
    streams = [_take(s, num_epochs * per_epoch) for s in samplers]
    left_out = []
    for e in range(num_epochs):
        trained = sum((st[e * per_epoch:(e + 1) * per_epoch] for st in streams), [])
        assert len(set(trained)) == len(trained) == per_epoch * dp_size  # no pack twice in an epoch
        left_out.append(frozenset(range(num_packs)) - set(trained))
    assert all(len(s) == num_packs % dp_size > 0 for s in left_out)  # the case really drops packs
    assert left_out[0] != left_out[1]  # not the same packs every epoch
    assert frozenset().union(*(frozenset(range(num_packs)) - s for s in left_out)) == frozenset(range(num_packs))


def test_shuffle_is_seeded_per_epoch_and_shards_cover_each_pack_once():
    num_packs, dp_size = 23, 3
    samplers = [PackSampler(num_packs, dp_rank=r, dp_size=dp_size, seed=5) for r in range(dp_size)]
    per_epoch = samplers[0].num_packs_per_epoch
    assert per_epoch == 7
    streams = [_take(s, 2 * per_epoch) for s in samplers]
    epochs = [sorted(sum((st[e * per_epoch:(e + 1) * per_epoch] for st in streams), [])) for e in range(2)]
    for packs in epochs:  # no pack twice in an epoch; 23 - 21 = 2 left for later epochs
        assert len(set(packs)) == len(packs) == 21
    assert streams[0][:per_epoch] != streams[0][per_epoch:]  # epochs differ
    assert _take(PackSampler(num_packs, dp_rank=0, dp_size=dp_size, seed=5), 9) == streams[0][:9]
    assert _take(PackSampler(num_packs, dp_rank=0, dp_size=dp_size, seed=6), 9) != streams[0][:9]
    # CP/TP ranks of one DP rank build the same sampler and so read the same packs
    assert _take(PackSampler(num_packs, dp_rank=1, dp_size=dp_size, seed=5), 14) == streams[1]


def test_iterating_does_not_move_the_resume_point():
    sampler = PackSampler(10, dp_rank=0, dp_size=1, seed=1)
    first = _take(sampler, 4)
    assert (sampler.epoch, sampler.consumed) == (0, 0) and _take(sampler, 4) == first
    sampler.advance(13)  # one epoch of 10 plus 3
    assert (sampler.epoch, sampler.consumed) == (1, 3)
    assert _take(sampler, 2) == list(sampler.epoch_order(1)[3:5])


@pytest.mark.parametrize("dp_size,new_dp_size,drop_last", [(2, 2, True), (2, 4, True), (4, 2, False)],
                         ids=["same-dp", "grow-dp", "shrink-dp-wrap"])
def test_resume_with_another_dp_size_continues_the_epoch(dp_size, new_dp_size, drop_last):
    num_packs, rounds = 16, 3
    old = [PackSampler(num_packs, dp_rank=r, dp_size=dp_size, seed=2, drop_last=drop_last) for r in range(dp_size)]
    seen = sum((_take(s, rounds) for s in old), [])
    old[0].advance(rounds)
    state = old[0].state_dict()
    assert state["consumed"] == rounds * dp_size
    new = [PackSampler(num_packs, dp_rank=r, dp_size=new_dp_size, seed=2, drop_last=drop_last)
           for r in range(new_dp_size)]
    for s in new:
        s.load_state_dict(state)
    rest = sum((_take(s, new[0]._num_rounds(s.consumed)) for s in new), [])
    order = old[0].epoch_order(0)
    if drop_last:  # the epoch finishes with a prefix of its order, no pack twice
        assert sorted(seen + rest) == sorted(order[:len(seen + rest)]) and len(seen + rest) >= num_packs - new_dp_size
    else:  # every pack at least once; the wrap-around repeats fewer packs than there are ranks
        assert set(seen + rest) == set(range(num_packs)) and len(seen + rest) - num_packs < new_dp_size


@pytest.mark.parametrize("state_change,pattern", [(dict(seed=9), "seed=9"), (dict(num_packs=11), "num_packs=11"),
                                                  (dict(version=0), "version"), (dict(consumed=99), "outside")],
                         ids=["seed", "num-packs", "version", "consumed"])
def test_load_state_refuses_mismatch(state_change, pattern):
    sampler = PackSampler(10, dp_rank=0, dp_size=1, seed=1)
    with pytest.raises(ValueError, match=pattern):
        sampler.load_state_dict({**sampler.state_dict(), **state_change})


def test_constructor_errors():
    with pytest.raises(ValueError, match="gives every rank nothing"):
        PackSampler(3, dp_rank=0, dp_size=4, seed=0)
    with pytest.raises(ValueError, match="dp_rank"):
        PackSampler(3, dp_rank=2, dp_size=2, seed=0)
    assert PackSampler(3, dp_rank=3, dp_size=4, seed=0, drop_last=False).num_packs_per_epoch == 1


class _Packs:
    """A tiny packed dataset: pack i holds samples 10*i and 10*i + 1."""

    def __init__(self, num_packs):
        self.num_packs = num_packs

    def __len__(self):
        return self.num_packs

    def __getitem__(self, i):
        return [{"input_ids": np.arange(3 + i % 4) + 5, "loss_mask": np.ones(3 + i % 4), "sample_id": 10 * i + j}
                for j in range(2)]


def _consume(loader, n):
    """``n`` steps of one pack per rank, as the training loop reads them (``begin_step`` first)."""
    iterator, out = iter(loader), []
    for _ in range(n):
        assert loader.begin_step().num_microbatches == 1
        out.append(next(iterator)["sample_ids"].tolist())
    return out


def build_pack_loader(dataset, collate, sampler: PackSampler, num_workers: int) -> StepLoader:
    """The offline loader of a fixed global batch of one pack per DP rank, dealt as ``sampler`` deals."""
    planner = StepPlanner(None, EpochOrder(sampler.num_packs, sampler.seed), StepRule(
        dp_size=sampler.dp_size, global_batch_size=sampler.dp_size))
    return StepLoader(dataset, collate, planner, dp_rank=sampler.dp_rank, seed=sampler.seed, num_workers=num_workers)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2], ids=["workers-0", "workers-2"])
def test_loader_resume_is_identical_to_an_uninterrupted_run(num_workers):
    dataset, collate = _Packs(7), make_collate_fn({"pack_size": 32}, pad_multiple=4)
    make = lambda: build_pack_loader(dataset, collate, PackSampler(7, dp_rank=1, dp_size=2, seed=3), num_workers)
    reference = _consume(make(), 11)  # 3 packs per epoch: crosses three epoch boundaries
    for stop_after in (2, 3, 5):
        first = make()
        head = _consume(first, stop_after)  # workers have prefetched beyond this point
        state = first.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        assert head + _consume(resumed, 11 - stop_after) == reference, stop_after
    assert len({tuple(ids) for ids in reference[:3]}) == 3 and reference[:3] != reference[3:6]


@pytest.mark.parametrize("num_workers", [0, 2], ids=["workers-0", "workers-2"])
def test_starting_the_loader_leaves_the_global_rng_alone(num_workers):
    """A resumed run restores the RNG and then starts its loader; a draw there would shift every later
    dropout mask (LoRA / model dropout) against the uninterrupted run."""
    import torch

    dataset, collate = _Packs(4), make_collate_fn({"pack_size": 32}, pad_multiple=4)
    loader = build_pack_loader(dataset, collate, PackSampler(4, dp_rank=0, dp_size=1, seed=3), num_workers)
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    assert len(_consume(loader, 2)) == 2
    assert torch.equal(torch.rand(3), want)
