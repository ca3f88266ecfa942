"""Balanced assignment of packs to DP ranks (data/packing/balance.py) and planned steps
(data/batches/steps.py): token budgets, every pack once per epoch, resume, imbalance."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.data.batches.steps import PackStats, StepPlanner, StepRule
from megatron_pack.data.packing.balance import (assign_balanced, imbalance, pack_cost, pipelined_cost, rank_loads,
                                                round_robin)

ASSIGN_CASES = [
    ("docstring", [8, 7, 6, 5, 4, 3, 2, 1], 2, 20 / 18, 1.0),
    ("equal", [3, 3, 3, 3], 2, 1.0, 1.0),
    # every rank keeps 3 packs (the round-robin counts), so the heavy pack's rank holds 10 + 1 + 1 either way
    ("one_heavy_count_bound", [10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 4, 12 / 5.25, 12 / 5.25),
    ("pairs", [9, 8, 2, 1], 2, 11 / 10, 1.0),
    ("uneven_count", [5, 4, 3, 2, 1], 2, 9 / 7.5, 8 / 7.5),
]


@pytest.mark.parametrize("costs,dp,before,after", [c[1:] for c in ASSIGN_CASES], ids=[c[0] for c in ASSIGN_CASES])
def test_assign_by_hand(costs, dp, before, after):
    costs = np.asarray(costs, dtype=float)
    assignment = assign_balanced(costs, dp)
    assert imbalance(costs, round_robin(len(costs), dp)) == pytest.approx(before)
    assert imbalance(costs, assignment) == pytest.approx(after)
    assert sorted(len(a) for a in assignment) == sorted(len(a) for a in round_robin(len(costs), dp))


# 25 packs on 10 ranks where the search alone (LPT + swaps) ends at a largest rank cost of 11.2310 and
# round-robin's is 11.1194: the deal taken is round-robin's (found in 20,000 random cases, module docstring)
LPT_WORSE_THAN_ROUND_ROBIN = [
    0.8678075259017184, 5.355765808657409, 0.34236294997522737, 0.7780699350085701, 1.7512993583620264,
    0.12426900958316871, 2.5039819251163347, 1.3134292695776935, 0.6918108240487293, 1.2343941470114073,
    1.139346560307502, 0.11161065341857043, 3.172831803054032, 0.6051430029475773, 8.042341849913651,
    10.99510301011709, 0.16362048486942832, 0.3408383545976433, 0.4241153111113632, 1.7868721488653412,
    0.1713397885479866, 0.1549204710591421, 5.902581124141025, 2.1256532852173384, 0.13279038028602216]

PIPELINED_CASES = [  # (id, costs, dp, pp, largest pipelined rank cost: round-robin, balanced by sums, balanced)
    ("docstring_pp4", [8, 7, 6, 5, 4, 3, 2, 1], 2, 4, 11.0, 10.5, 10.25),
    ("pp1_is_the_sum", [8, 7, 6, 5, 4, 3, 2, 1], 2, 1, 20.0, 18.0, 18.0),
    # the heavy pack's rank: (9 + 1 + 1 + (3 - 1) * 9) / 3 either way; the sums balance is already the best
    ("one_heavy_pp3", [9, 1, 1, 1, 5, 5], 2, 3, 11.0, 29 / 3, 29 / 3),
    # PP=2: round-robin {8, 5, 3} (16 + 8) / 2 = 12; by sums {8, 4, 3} = 15 vs {6, 5, 3} = 14, pipelined
    # (15 + 8) / 2 = 11.5; balanced {8, 3, 3}: (14 + 8) / 2 = 11 and {6, 5, 4}: (15 + 6) / 2 = 10.5
    ("pp2_moves_work_off_the_largest", [8, 6, 5, 4, 3, 3], 2, 2, 12.0, 11.5, 11.0),
]


@pytest.mark.parametrize("costs,dp,pp,round_robin_max,by_sums_max,balanced_max", [c[1:] for c in PIPELINED_CASES],
                         ids=[c[0] for c in PIPELINED_CASES])
def test_pipelined_cost_by_hand(costs, dp, pp, round_robin_max, by_sums_max, balanced_max):
    costs = np.asarray(costs, dtype=float)
    assert rank_loads(costs, round_robin(len(costs), dp), pp).max() == pytest.approx(round_robin_max)
    assert rank_loads(costs, assign_balanced(costs, dp), pp).max() == pytest.approx(by_sums_max)
    assert rank_loads(costs, assign_balanced(costs, dp, pp), pp).max() == pytest.approx(balanced_max)


def test_pipelined_cost_formula():
    assert pipelined_cost([4, 2, 2], 2) == (8 + 4) / 2
    assert pipelined_cost([4, 2, 2], 1) == 8
    assert pipelined_cost([], 4) == 0.0
    assert pipelined_cost([3], 4) == 3.0  # one micro-batch crosses every stage: the whole model's cost


def test_search_worse_than_round_robin_takes_round_robin():
    costs = np.asarray(LPT_WORSE_THAN_ROUND_ROBIN)
    rr = rank_loads(costs, round_robin(len(costs), 10)).max()
    got = rank_loads(costs, assign_balanced(costs, 10)).max()
    assert got <= rr and rr == pytest.approx(11.119372019700258)


def test_pack_cost_is_linear_plus_squares():
    assert pack_cost([3, 4], a=2.0, b=0.5) == 2 * 7 + 0.5 * (9 + 16)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.floats(0, 1e6), min_size=1, max_size=80), dp=st.integers(1, 16))
def test_every_pack_is_assigned_exactly_once_and_never_worse(costs, dp):
    costs = np.asarray(costs)
    assignment = assign_balanced(costs, dp)
    flat = np.concatenate(assignment)
    assert sorted(flat.tolist()) == list(range(len(costs)))
    assert [len(a) for a in assignment] == [len(a) for a in round_robin(len(costs), dp)]
    for a in assignment:  # slot order: longest first on every rank
        assert np.all(np.diff(costs[a]) <= 0)
    assert imbalance(costs, assignment) <= imbalance(costs, round_robin(len(costs), dp)) + 1e-9
    assert [a.tolist() for a in assign_balanced(costs, dp)] == [a.tolist() for a in assignment]  # deterministic


@settings(max_examples=80, deadline=None)
@given(costs=st.lists(st.floats(0, 1e6), min_size=1, max_size=60), dp=st.integers(1, 12), pp=st.integers(2, 8))
def test_pipelined_balance_never_exceeds_round_robin_nor_the_sums_balance(costs, dp, pp):
    costs = np.asarray(costs)
    assignment = assign_balanced(costs, dp, pp)
    assert sorted(np.concatenate(assignment).tolist()) == list(range(len(costs)))
    assert [len(a) for a in assignment] == [len(a) for a in round_robin(len(costs), dp)]
    worst = rank_loads(costs, assignment, pp).max()
    assert worst <= rank_loads(costs, round_robin(len(costs), dp), pp).max() * (1 + 1e-12)
    assert worst <= rank_loads(costs, assign_balanced(costs, dp), pp).max() * (1 + 1e-12)
    assert worst >= costs.max() * (1 - 1e-12)  # no deal beats the largest pack crossing every stage


def long_tailed_packs(rng: np.random.Generator, num_packs: int, pack_size: int = 4096) -> list[np.ndarray]:
    """Packs of lognormal sub-sequence lengths (sigma 1.3: a few near-pack-long samples), filled greedily."""
    packs = []
    for _ in range(num_packs):
        lengths, room = [], pack_size
        while True:
            n = int(min(rng.lognormal(np.log(300), 1.3), pack_size))
            if n > room:
                break
            lengths.append(n)
            room -= n
        packs.append(np.asarray(lengths or [pack_size]))
    return packs


def test_long_tailed_dp8_gbs64_is_within_five_percent():
    rng = np.random.default_rng(0)
    before, after = [], []
    for _ in range(50):
        costs = np.array([pack_cost(p) for p in long_tailed_packs(rng, 64)])
        before.append(imbalance(costs, round_robin(64, 8)))
        after.append(imbalance(costs, assign_balanced(costs, 8)))
    print(f"DP=8 gbs=64 long-tailed: max/mean unbalanced mean {np.mean(before):.3f} worst {max(before):.3f}; "
          f"balanced mean {np.mean(after):.4f} worst {max(after):.4f}")
    assert max(after) <= 1.05
    assert np.mean(before) > 1.1, "the mix is not long-tailed enough to test balancing"


# ----- planned steps --------------------------------------------------------------------------

def planner(tokens, *, dp=2, gbs=2, budget=None, balance="none", seed=0, real=None) -> StepPlanner:
    tokens = np.asarray(tokens, dtype=np.int64)
    stats = PackStats(real_tokens=np.asarray(real if real is not None else tokens, dtype=np.int64),
                      target_tokens=tokens, squared_lengths=tokens * tokens)

    def order(epoch):
        return np.random.default_rng([seed, epoch]).permutation(len(tokens)) if seed else np.arange(len(tokens))

    return StepPlanner(stats, order, StepRule(dp_size=dp, global_batch_size=gbs, global_batch_tokens=budget,
                                              balance=balance))


def take(p: StepPlanner, n: int, start=(0, 0)):
    it = p.steps(*start)
    return [next(it) for _ in range(n)]


def test_docstring_budget_example():
    steps = take(planner([5, 1, 4, 3, 2, 6], budget=7), 2)
    assert [s.packs.tolist() for s in steps] == [[0, 1, 2], [3, 4, 5]]
    assert [s.tokens for s in steps] == [10, 11]
    assert [len(r) for r in steps[0].per_rank] == [2, 1]


def test_budget_counts_real_tokens_when_asked():
    p = planner([1, 1, 1, 1], real=[5, 5, 5, 5], budget=9, dp=1)
    p = StepPlanner(p.stats, p.epoch_order, dataclasses.replace(p.rule, budget_kind="real"))
    assert [s.packs.tolist() for s in take(p, 2)] == [[0, 1], [2, 3]]


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(1, 500), min_size=4, max_size=60), dp=st.integers(1, 4),
       budget=st.integers(1, 1500), seed=st.integers(0, 5))
def test_budget_steps_are_within_one_pack_and_use_each_pack_once(tokens, dp, budget, seed):
    if sum(tokens) < budget or len(tokens) < dp:
        return
    p = planner(tokens, dp=dp, budget=budget, seed=seed, balance="dp")
    epoch0_steps = []
    for s in p.steps(0, 0):
        if 0 in p.left_out:  # the planner has moved past epoch 0: this step is epoch 1's
            break
        epoch0_steps.append(s)
    assert epoch0_steps, "no step planned: the case would pass vacuously"
    used = [i for s in epoch0_steps for i in s.packs.tolist()]
    assert len(used) == len(set(used))
    assert len(used) + p.left_out[0] == len(tokens)
    for s in epoch0_steps:
        got = np.asarray(tokens)[s.packs]
        assert got.sum() >= budget
        if len(s.packs) > dp:  # more than the one-per-rank floor: the last pack is the one that met the budget
            assert got[:-1].sum() < budget
        assert sorted(np.concatenate(s.per_rank).tolist()) == sorted(s.packs.tolist())


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_every_pack_once_per_epoch_at_any_dp(dp):
    num_packs = 8 * dp * 3
    p = planner(np.arange(1, num_packs + 1), dp=dp, gbs=4 * dp, balance="dp", seed=7)
    by_epoch: dict[int, list[int]] = {0: [], 1: []}
    for s in take(p, 12):
        epoch = s.end[0] if s.end[1] else s.end[0] - 1
        by_epoch[epoch] += np.concatenate(s.per_rank).tolist()
    for epoch in (0, 1):
        assert sorted(by_epoch[epoch]) == list(range(num_packs))


def test_resume_point_continues_with_the_same_steps():
    p = planner(np.random.default_rng(1).integers(1, 100, 50), dp=3, budget=200, balance="dp", seed=3)
    whole = take(p, 20)
    again = take(p, 12, start=whole[7].end)
    for a, b in zip(whole[8:], again):
        assert a.packs.tolist() == b.packs.tolist()
        assert [r.tolist() for r in a.per_rank] == [r.tolist() for r in b.per_rank]


def test_planner_balances_and_reports_the_pipelined_cost():
    """At PP=4 the planner deals by the pipelined cost, and the imbalance it reports is the pipelined one."""
    tokens = np.random.default_rng(2).integers(1, 2000, 64)
    flat = take(planner(tokens, dp=8, gbs=64, balance="dp", seed=1), 1)[0]
    p = planner(tokens, dp=8, gbs=64, balance="dp", seed=1)
    p = StepPlanner(p.stats, p.epoch_order, dataclasses.replace(p.rule, pp_size=4))
    s = take(p, 1)[0]
    costs = p.costs
    loads = np.array([pipelined_cost(costs[r], 4) for r in s.per_rank])
    assert s.imbalance_after == pytest.approx(loads.max() / loads.mean())
    pipelined = lambda step: max(pipelined_cost(costs[r], 4) for r in step.per_rank)  # noqa: E731
    assert pipelined(s) <= pipelined(flat)
    assert s.imbalance_after <= s.imbalance_before and s.imbalance_before > 1.02  # something to balance


def test_step_rule_carries_the_pipeline_size():
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.loader import step_rule

    for pp in (1, 2):
        cfg = load_config([f"parallel.pipeline_model_parallel_size={pp}", "packing.balance=dp"])
        assert step_rule(cfg, dp_size=2).pp_size == pp


def test_balanced_deal_is_reported_and_not_worse():
    p = planner(np.random.default_rng(2).integers(1, 2000, 64), dp=8, gbs=64, balance="dp", seed=1)
    s = take(p, 1)[0]
    assert s.imbalance_after <= s.imbalance_before
    assert s.imbalance_before > 1.05  # the guard: there was something to balance


# ----- StepLoader on a prepared dataset --------------------------------------------------------

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    overrides = ["data.synthetic_num_samples=200", f"data.dataset_dir={tmp_path_factory.mktemp('steps') / 'ds'}",
                 "packing.packed_sequence_size=256", "model.seq_length=256", "data.tokenize_workers=1",
                 "train.global_batch_size=4"]
    prepare(load_config(overrides), progress=False)
    return overrides


def _step_loader(overrides, *extra, dp_rank=0, dp_size=2):
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.loader import build_loader
    from megatron_pack.data.batches.opening import open_dataset

    cfg = load_config(overrides + list(extra))
    return build_loader(cfg, open_dataset(cfg), dp_rank=dp_rank, dp_size=dp_size)


def _loader_steps(loader, num_steps):
    it, out = iter(loader), []
    for _ in range(num_steps):
        info = loader.begin_step()  # before the first next(): the resume point must not move under it
        out.append([next(it) for _ in range(info.num_microbatches)])
    return out


@pytest.mark.parametrize("dp_size", [2, 3])
def test_step_loader_ranks_share_each_budget_step_and_meet_it_within_one_pack(prepared, dp_size):
    budget = 1000  # 4 steps stay inside epoch 0 (the dataset holds ~6000 target tokens)
    per_rank = [_loader_steps(_step_loader(prepared, f"train.global_batch_tokens={budget}", "packing.balance=dp",
                                           dp_rank=r, dp_size=dp_size), 4) for r in range(dp_size)]
    seen = []
    for step in range(4):
        batches = [b for r in range(dp_size) for b in per_rank[r][step]]
        tokens = sorted(int(b["num_target_tokens"]) for b in batches)
        assert budget <= sum(tokens) < budget + max(tokens)  # over by less than the pack that met it
        seen += [tuple(b["sample_ids"].tolist()) for b in batches]
    assert len(seen) == len(set(seen)) > 4 * dp_size  # no pack twice in the epoch


def test_step_loader_resumes_at_the_next_step(prepared):
    extra = ("train.global_batch_tokens=1500", "packing.balance=dp")
    whole = [[b["sample_ids"].tolist() for b in s] for s in _loader_steps(_step_loader(prepared, *extra), 7)]
    first = _step_loader(prepared, *extra)
    got = [[b["sample_ids"].tolist() for b in s] for s in _loader_steps(first, 3)]
    resumed = _step_loader(prepared, *extra)
    resumed.load_state_dict(first.state_dict())
    got += [[b["sample_ids"].tolist() for b in s] for s in _loader_steps(resumed, 4)]
    assert got == whole
    other = _step_loader(prepared, "train.global_batch_tokens=1600", "packing.balance=dp")
    with pytest.raises(ValueError, match="global_batch_tokens=1500 but this run has 1600"):
        other.load_state_dict(first.state_dict())


def test_step_loader_resumes_at_another_dp_size_with_the_same_packs(prepared):
    """The resume point is global: a dp=2 checkpoint resumed at dp=1 (and dp=3) trains the same packs per step."""
    extra = ("train.global_batch_tokens=1500", "packing.balance=dp")
    two = [_step_loader(prepared, *extra, dp_rank=r, dp_size=2) for r in range(2)]
    for loader in two:
        _loader_steps(loader, 3)
    state = two[0].state_dict()
    assert state == two[1].state_dict() and state["consumed"] > 0  # the same global point on every rank
    expected = [[{tuple(b["sample_ids"].tolist()) for b in step} for step in _loader_steps(loader, 4)] for loader in two]
    for dp_size in (1, 3):
        ranks = [_step_loader(prepared, *extra, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
        got = []
        for loader in ranks:
            loader.load_state_dict(state)
            got.append([{tuple(b["sample_ids"].tolist()) for b in step} for step in _loader_steps(loader, 4)])
        for step in range(4):
            packs = set().union(*(g[step] for g in got))
            assert packs == expected[0][step] | expected[1][step] and len(packs) > 3  # steps reach past dp
