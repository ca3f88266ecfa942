"""plan_packing: hand-computed cases, and hypothesis properties for every algorithm."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.data.packing.algorithms import BIN_PACKING_ALGORITHMS as ALGORITHMS
from megatron_pack.data.packing.algorithms import lower_bound_bins, plan_packing, thd_lengths


def _bins_as_lengths(plan, lengths):
    return sorted(sorted(np.asarray(lengths)[b].tolist()) for b in plan.bins())


HAND_CASES = [
    # (lengths, capacity, algorithm, expected bins as sorted length lists)
    ([128, 128, 256, 512], 1024, "bfd", [[128, 128, 256, 512]]),
    ([128, 128, 256, 512], 1024, "ffd", [[128, 128, 256, 512]]),
    ([4, 2, 3, 3], 6, "bfd", [[2, 4], [3, 3]]),
    ([4, 2, 3, 3], 6, "ffd", [[2, 4], [3, 3]]),
    ([5, 4, 3, 2, 2], 8, "ffd", [[2, 2, 4], [3, 5]]),
    ([5, 4, 3, 2, 2], 8, "bfd", [[2, 2, 4], [3, 5]]),
    # next fit keeps input order: 5 | 4 3 | 2 2
    ([5, 4, 3, 2, 2], 8, "sequential", [[2, 2], [3, 4], [5]]),
    # best fit differs from first fit: after 6 and 5 (bins left 4 and 5), a 4 goes to the tighter bin 0
    ([6, 5, 4, 4], 10, "bfd", [[4, 5], [4, 6]]),
    ([7, 3, 3, 3, 2, 2], 10, "bfd", [[2, 2, 3, 3], [3, 7]]),
]


@pytest.mark.parametrize("lengths,capacity,algorithm,expected", HAND_CASES,
                         ids=[f"{a}-{c}-{'_'.join(map(str, l))}" for l, c, a, _ in HAND_CASES])
def test_hand_cases(lengths, capacity, algorithm, expected):
    plan = plan_packing(lengths, capacity, algorithm)
    assert _bins_as_lengths(plan, lengths) == expected
    assert plan.num_bins == len(expected)


@pytest.mark.parametrize("lengths,capacity,num_bins,efficiency", [
    ([128, 128, 256, 512], 1024, 1, 1.0), ([4, 2, 3, 3], 6, 2, 1.0), ([5, 4, 3, 2, 2], 8, 2, 1.0)],
    ids=["one-full-pack", "two-full-packs", "ffd-example"])
def test_efficiency(lengths, capacity, num_bins, efficiency):
    plan = plan_packing(lengths, capacity)
    assert (plan.num_bins, plan.efficiency) == (num_bins, efficiency)
    assert plan.lower_bound == num_bins


@pytest.mark.parametrize("num_ids,mult,expected", [([5, 9, 1], 4, [4, 8, 0]), ([2, 3], 1, [1, 2]),
                                                   ([9, 10], 8, [8, 16])], ids=["mult4", "mult1", "mult8"])
def test_thd_lengths(num_ids, mult, expected):
    assert thd_lengths(num_ids, mult).tolist() == expected


@pytest.mark.parametrize("lengths,capacity,algorithm,match", [
    ([3, 9], 8, "bfd", "outside"), ([0, 2], 8, "ffd", "outside"), ([1], 8, "best", "unknown"),
    ([1], 0, "bfd", "capacity")], ids=["too-long", "zero", "bad-algorithm", "bad-capacity"])
def test_bad_input(lengths, capacity, algorithm, match):
    with pytest.raises(ValueError, match=match):
        plan_packing(lengths, capacity, algorithm)


def test_empty():
    plan = plan_packing([], 16)
    assert (plan.num_bins, plan.bins(), plan.efficiency) == (0, [], 0.0)


lengths_strategy = st.integers(1, 64).flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), min_size=1, max_size=300)))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=60, deadline=None)
@given(case=lengths_strategy, seed=st.integers(0, 3))
def test_properties(algorithm, case, seed):
    capacity, lengths = case
    plan = plan_packing(lengths, capacity, algorithm, seed)
    everything = np.sort(np.concatenate(plan.bins()))
    assert np.array_equal(everything, np.arange(len(lengths)))  # each sample exactly once
    assert all(b.size > 0 for b in plan.bins())
    assert plan.bin_loads().max() <= capacity
    assert plan.num_bins >= math.ceil(sum(lengths) / capacity) == lower_bound_bins(lengths, capacity)
    again = plan_packing(lengths, capacity, algorithm, seed)
    assert np.array_equal(again.order, plan.order) and np.array_equal(again.bin_offsets, plan.bin_offsets)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=60, deadline=None)
@given(case=lengths_strategy)
def test_any_fit_bound(algorithm, case):
    """No two bins of an any-fit plan are both at most half full, so bins <= 2 * sum / capacity + 1."""
    capacity, lengths = case
    assert plan_packing(lengths, capacity, algorithm).num_bins <= 2 * sum(lengths) / capacity + 1


def test_bfd_can_lose_to_ffd_on_a_crafted_case():
    """Best fit decreasing does not dominate first fit decreasing in general (found by search)."""
    lengths = [23, 18, 14, 13, 12, 11, 9, 6, 3, 2, 2, 2]
    assert (plan_packing(lengths, 23, "bfd").num_bins, plan_packing(lengths, 23, "ffd").num_bins) == (6, 5)


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"seed{s}")
def test_bfd_not_worse_than_ffd_on_realistic_lengths(seed):
    """On long-tailed SFT-like length mixes bfd never needs more packs than ffd."""
    rng = np.random.default_rng(seed)
    for capacity in (512, 1024, 4096):
        lengths = np.clip(rng.lognormal(np.log(capacity / 10), 1.0, 20_000).astype(np.int64), 1, capacity)
        bfd, ffd = plan_packing(lengths, capacity, "bfd"), plan_packing(lengths, capacity, "ffd")
        assert bfd.num_bins <= ffd.num_bins
        assert bfd.num_bins > 100


def _reference_fit(lengths, capacity, best):
    """Textbook sample-by-sample BFD / FFD, to check the histogram version packs the same."""
    remaining = []
    for length in sorted(lengths, reverse=True):
        fits = [i for i, r in enumerate(remaining) if r >= length]
        if not fits:
            remaining.append(capacity - length)
            continue
        i = min(fits, key=lambda j: (remaining[j], j)) if best else fits[0]
        remaining[i] -= length
    return sorted(remaining)


@pytest.mark.parametrize("algorithm", ["bfd", "ffd"])
@settings(max_examples=80, deadline=None)
@given(case=lengths_strategy)
def test_histogram_matches_sample_by_sample(algorithm, case):
    capacity, lengths = case
    plan = plan_packing(lengths, capacity, algorithm)
    assert sorted((capacity - plan.bin_loads()).tolist()) == _reference_fit(lengths, capacity, algorithm == "bfd")


def test_seed_shuffles_bin_order_but_sequential_keeps_order():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, 2000)
    a, b = plan_packing(lengths, 256, "bfd", 0), plan_packing(lengths, 256, "bfd", 1)
    assert a.num_bins == b.num_bins > 100
    assert not np.array_equal(a.order, b.order)
    seq = plan_packing(lengths, 256, "sequential", 5)
    assert np.array_equal(seq.order, np.arange(len(lengths)))


def test_large_plan_is_tight():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(400) - 0.5, 1.0, 200_000).astype(np.int64), 1, 4096)
    plan = plan_packing(lengths, 4096, "bfd")
    assert plan.bin_loads().max() <= 4096
    assert plan.num_bins <= plan.lower_bound * 1.001 + 1
    assert np.array_equal(np.sort(plan.order), np.arange(len(lengths)))


@pytest.mark.parametrize("algorithm", ["bfd", "ffd"])
@settings(max_examples=40, deadline=None)
@given(case=lengths_strategy, multiple=st.sampled_from([2, 4, 8]))
def test_padded_lengths_plan_in_units_of_the_multiple(algorithm, case, multiple):
    """Lengths padded to a multiple are planned on a histogram scaled down by it: same packs."""
    capacity, lengths = case
    scaled = [length * multiple for length in lengths]
    plan = plan_packing(scaled, capacity * multiple, algorithm)
    assert sorted((capacity * multiple - plan.bin_loads()).tolist()) == [
        r * multiple for r in _reference_fit(lengths, capacity, algorithm == "bfd")]


def test_large_capacity_uses_block_index():
    """Long-context packs (128k tokens): many distinct lengths and buckets spread over 2048 blocks."""
    rng = np.random.default_rng(2)
    lengths = np.clip(rng.lognormal(np.log(8000), 1.2, 8_000).astype(np.int64), 1, 131072)
    plan = plan_packing(lengths, 131072, "bfd")
    assert len(np.unique(lengths)) > 5_000
    assert plan.bin_loads().max() <= 131072 and plan.num_bins <= plan.lower_bound + 2
    assert np.array_equal(np.sort(plan.order), np.arange(len(lengths)))
