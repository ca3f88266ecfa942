"""Optimizer steps made of offline packs: a token budget per step and/or packs balanced over DP ranks.

``PackLoader`` (sampler.py) deals a fixed ``global_batch_size`` packs per step round-robin. This
module plans whole steps instead, the same on every rank (it reads only the plan's lengths):

1. take packs from the epoch's seeded order (``PackSampler.epoch_order``): ``global_batch_size``
   of them, or, with ``train.global_batch_tokens``, packs until their target (or real) tokens
   reach the budget, and at least one per DP rank. So a step overshoots the budget by less than
   its last pack. Packs left at the end of an epoch that cannot fill a step are left out of that
   epoch (counted and logged; the next epoch's order is another permutation);
2. deal them to DP ranks: round-robin (rank ``r`` takes packs ``r, r+dp, ...`` of the step), or
   with ``packing.balance=dp`` by ``megatron_pack.data.packing.balance.assign_balanced`` on the
   cost ``a * real + b * sum(len^2)``. Both imbalances (max/mean rank cost) are recorded.

Example, 6 packs of target tokens ``[5, 1, 4, 3, 2, 6]`` in epoch order, budget 7, DP 2::

    step 1: packs 0, 1, 2 (5 + 1 = 6 < 7, + 4 = 10 >= 7) -> tokens 10
    step 2: packs 3, 4, 5 (3 + 2 = 5 < 7, + 6 = 11 >= 7) -> tokens 11

The resume point is ``(epoch, consumed)``: the packs of the epoch's order planned into steps
that the loop has begun (``begin_step``). A checkpoint taken after a step therefore resumes at
the next step, with the same packs on the same ranks. The point is global, so a run may resume
at another DP size: the next steps take the same packs of the same order, dealt to more or fewer
ranks, except where "at least one pack per rank" decides a step's size (``max(reach, dp)``: a
step whose budget is met by fewer packs than DP ranks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from megatron_pack.config.choices import DEFAULT_COST_A, DEFAULT_COST_B
from megatron_pack.data.packing.balance import assign_balanced, imbalance, round_robin

log = logging.getLogger("megatron_pack.train")
STATE_VERSION = 1


@dataclass(frozen=True)
class PackStats:
    """Per-pack numbers the planner needs (int64 [num_packs] each)."""

    real_tokens: np.ndarray
    target_tokens: np.ndarray
    squared_lengths: np.ndarray
    """Sum over the pack's samples of (real THD length)^2."""

    def cost(self, a: float, b: float) -> np.ndarray:
        return a * self.real_tokens.astype(np.float64) + b * self.squared_lengths.astype(np.float64)


def pack_stats(dataset) -> PackStats:
    """``PackStats`` of a ``PackedSFTDataset`` from its plan and the store's answer counts."""
    offsets = np.asarray(dataset.bin_offsets, dtype=np.int64)
    order = np.asarray(dataset.sample_order, dtype=np.int64)
    take = np.asarray(dataset.sample_num_ids, dtype=np.int64)
    store = dataset.store
    targets = np.asarray(store.num_targets, dtype=np.int64)[order]
    truncated = np.flatnonzero(take < np.diff(np.asarray(store.offsets, dtype=np.int64))[order])
    for k in truncated:  # a truncated sample keeps only the answer tokens it still holds
        start = int(store.offsets[order[k]])
        targets[k] = int(np.asarray(store.answer_mask[start + 1:start + take[k]]).sum())
    thd = take - 1
    starts = offsets[:-1]
    return PackStats(np.add.reduceat(thd, starts), np.add.reduceat(targets, starts),
                     np.add.reduceat(thd * thd, starts))


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: its packs, who trains which, and what it weighs."""

    packs: np.ndarray
    """Global pack indices of the step, in epoch order."""
    per_rank: list[np.ndarray]
    """Pack indices per DP rank, in micro-batch slot order."""
    tokens: int
    """Tokens of the step counted against the budget (target or real, per ``budget_kind``)."""
    imbalance_before: float
    """Max/mean rank cost of the round-robin deal."""
    imbalance_after: float
    """Max/mean rank cost of the deal used (equal to before without balancing)."""
    end: tuple[int, int]
    """Resume point after this step: (epoch, packs of its order consumed)."""


@dataclass(frozen=True)
class StepRule:
    """How the planner cuts and deals steps (from ``train.*`` and ``packing.*``)."""

    dp_size: int
    global_batch_size: int
    global_batch_tokens: Optional[int] = None
    budget_kind: str = "target"
    balance: str = "none"
    cost_a: float = DEFAULT_COST_A
    cost_b: float = DEFAULT_COST_B


class StepPlanner:
    """Deterministic steps over epochs of ``num_packs`` packs ordered by ``epoch_order(epoch)``."""

    def __init__(self, stats: PackStats, epoch_order: Callable[[int], np.ndarray], rule: StepRule):
        self.stats, self.epoch_order, self.rule = stats, epoch_order, rule
        self.costs = stats.cost(rule.cost_a, rule.cost_b)
        self.budget_tokens = stats.target_tokens if rule.budget_kind == "target" else stats.real_tokens
        self.left_out: dict[int, int] = {}
        """Packs each epoch left out (epoch -> count), for the log and tests."""

    def steps(self, epoch: int, consumed: int) -> Iterator[StepPlan]:
        """Steps from the resume point on, epoch after epoch (endless)."""
        while True:
            order = self.epoch_order(epoch)
            while True:
                size = self._step_size(order, consumed)
                if size is None:
                    break
                packs = order[consumed:consumed + size]
                consumed += size
                yield self._deal(packs, (epoch, consumed))
            self._leave_out(epoch, len(order) - consumed)
            epoch, consumed = epoch + 1, 0

    def _step_size(self, order: np.ndarray, consumed: int) -> Optional[int]:
        rest = len(order) - consumed
        r = self.rule
        if r.global_batch_tokens is None:
            return r.global_batch_size if rest >= r.global_batch_size else None
        tokens = np.cumsum(self.budget_tokens[order[consumed:]])
        reach = int(np.searchsorted(tokens, r.global_batch_tokens)) + 1  # packs until the budget is met
        size = max(reach, r.dp_size)
        return size if size <= rest and tokens[size - 1] >= r.global_batch_tokens else None

    def _deal(self, packs: np.ndarray, end: tuple[int, int]) -> StepPlan:
        dp = self.rule.dp_size
        costs = self.costs[packs]
        before = round_robin(len(packs), dp)
        after = assign_balanced(costs, dp) if self.rule.balance == "dp" else before
        return StepPlan(packs=packs, per_rank=[packs[a] for a in after],
                        tokens=int(self.budget_tokens[packs].sum()),
                        imbalance_before=imbalance(costs, before), imbalance_after=imbalance(costs, after), end=end)

    def _leave_out(self, epoch: int, count: int) -> None:
        if epoch not in self.left_out:
            self.left_out[epoch] = count
            if count:
                log.info("epoch %d: the last %d packs of its order do not fill a step; they are left out of this "
                         "epoch (the next epoch's order is another permutation)", epoch, count)


@dataclass(frozen=True)
class StepInfo:
    """What the loop needs to know about the step it begins."""

    num_microbatches: int
    """Packs this DP rank trains in the step."""
    tokens: Optional[int] = None
    """Budget tokens of the whole step (global), when a planner knows them."""
    imbalance_before: Optional[float] = None
    imbalance_after: Optional[float] = None


class _PlannedSampler(Sampler[int]):
    """This rank's pack indices of successive planned steps, from the loader's resume point."""

    def __init__(self, loader: "StepLoader"):
        self.loader = loader

    def __iter__(self) -> Iterator[int]:
        # the resume point is read now, when the DataLoader iterator is made, not at its first
        # next() (a generator body runs late: after begin_step() has already moved the point)
        plans, rank = self.loader.planner.steps(self.loader.epoch, self.loader.consumed), self.loader.dp_rank
        return (int(pack) for plan in plans for pack in plan.per_rank[rank])


class StepLoader:
    """THD batches of planned steps for one DP rank; ``begin_step()`` before each step's micro-batches."""

    def __init__(self, dataset: Any, collate_fn: Callable, planner: StepPlanner, *, dp_rank: int, seed: int,
                 num_workers: int = 0, pin_memory: bool = False):
        self.planner, self.dp_rank, self.seed, self.num_packs = planner, dp_rank, seed, len(dataset)
        self.epoch, self.consumed = 0, 0
        # its own generator: making the iterator after a resume draws nothing from the global torch RNG
        # (PackLoader does the same; the draw would shift every later dropout mask)
        kwargs: dict[str, Any] = {"pin_memory": pin_memory and torch.cuda.is_available(),
                                  "generator": torch.Generator().manual_seed(0)}
        if num_workers > 0:
            kwargs["prefetch_factor"] = 2
        self._loader = DataLoader(dataset, batch_size=None, sampler=_PlannedSampler(self), collate_fn=collate_fn,
                                  num_workers=num_workers, **kwargs)
        self._plans: Optional[Iterator[StepPlan]] = None

    def __iter__(self) -> Iterator[dict]:
        self._plans = self.planner.steps(self.epoch, self.consumed)
        return iter(self._loader)

    def begin_step(self) -> StepInfo:
        """Plan the next step; afterwards ``state_dict()`` resumes after it."""
        if self._plans is None:
            raise RuntimeError("StepLoader.begin_step() before iter(loader)")
        plan = next(self._plans)
        self.epoch, self.consumed = plan.end
        return StepInfo(num_microbatches=len(plan.per_rank[self.dp_rank]), tokens=plan.tokens,
                        imbalance_before=plan.imbalance_before, imbalance_after=plan.imbalance_after)

    def state_dict(self) -> dict:
        r = self.planner.rule
        return {"version": STATE_VERSION, "kind": "steps", "epoch": self.epoch, "consumed": self.consumed,
                "num_packs": self.num_packs, "seed": self.seed, "dp_size": r.dp_size,
                "global_batch_tokens": r.global_batch_tokens, "balance": r.balance}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or state.get("kind") != "steps":
            raise ValueError(f"loader state {dict(state)!r} was not written by a planned-step loader (token budget "
                             "or packing.balance=dp); resume with the same train.global_batch_tokens and "
                             "packing.balance, or start without checkpoint.load.")
        # the resume point is global (a position in the epoch's order), so another dp_size resumes too
        for key in ("num_packs", "seed", "global_batch_tokens", "balance"):
            if state.get(key) != self.state_dict()[key]:
                raise ValueError(f"loader state from the checkpoint has {key}={state.get(key)!r} but this run has "
                                 f"{self.state_dict()[key]!r}; resume with the same dataset, train.seed, "
                                 "train.global_batch_tokens and packing.balance, or start without checkpoint.load.")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._plans = None
