"""Optimizer steps of offline packs: the step planner and ``StepLoader``, the loader of every offline run.

Every offline run (a prepared plan, or ``packing.mode=in_batch``'s micro-batches) reads its batches
through ``StepLoader``, which plans whole steps the same on every rank (it reads only the plan's
lengths):

1. the epoch order (``sampler.EpochOrder``): every pack, in a permutation seeded by
   ``(train.seed, epoch)``; bucket after bucket with ``packing.bucket_order=sequential``;
2. a step's packs, by one of two rules (``StepRule``):

   - a fixed count, ``train.global_batch_size`` packs (micro-batches of ``micro_batch_size``
     samples with in-batch packing): the next packs of the epoch orders one after the other,
     each epoch's order cut to a multiple of the DP size (its last ``num_packs % dp`` packs wait
     for a later epoch; logged by ``build_loader``); a step may span two epochs;
   - a token budget, ``train.global_batch_tokens``: packs until their target (or real) tokens
     reach the budget, and at least one per DP rank, within one epoch. So a step overshoots the
     budget by less than its last pack. Packs left at the end of an epoch that cannot fill a step
     are left out of that epoch (counted and logged; the next epoch's order is another permutation);
3. the deal: round-robin (rank ``r`` takes packs ``r, r+dp, ...`` of the step: the fixed count with
   it deals exactly as ``sampler.PackSampler``), or with ``packing.balance=dp`` by
   ``megatron_pack.data.packing.balance.assign_balanced`` on the cost ``a * real + b * sum(len^2)``
   (at PP>1 a rank's cost is its packs' pipelined cost, ``balance.pipelined_cost``).
   With a budget or balancing, both imbalances (max/mean rank cost) are reported.

Example, 6 packs of target tokens ``[5, 1, 4, 3, 2, 6]`` in epoch order, budget 7, DP 2::

    step 1: packs 0, 1, 2 (5 + 1 = 6 < 7, + 4 = 10 >= 7) -> tokens 10
    step 2: packs 3, 4, 5 (3 + 2 = 5 < 7, + 6 = 11 >= 7) -> tokens 11

The resume point is ``(epoch, consumed)``: the packs of the epoch's order planned into steps
that the loop has begun (``begin_step``). A checkpoint taken after a step therefore resumes at
the next step, with the same packs on the same ranks. The point is global, so a run may resume
at another DP size: the next steps take the same packs of the same order, dealt to more or fewer
ranks, except where "at least one pack per rank" decides a budget step's size (``max(reach, dp)``)
and where the epoch's cut to a multiple of the DP size moves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from megatron_pack.config.choices import DEFAULT_COST_A, DEFAULT_COST_B
from megatron_pack.data.batches.protocol import LoaderInfo, StepInfo
from megatron_pack.data.packing.balance import assign_balanced, imbalance, round_robin

log = logging.getLogger("megatron_pack.train")
STATE_VERSION = 1
__all__ = ["PackStats", "StepInfo", "StepLoader", "StepPlan", "StepPlanner", "StepRule", "pack_stats"]


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
    tokens: Optional[int]
    """Tokens of the step counted against the budget (target or real, per ``budget_kind``); None without stats."""
    imbalance_before: Optional[float]
    """Max/mean rank cost of the round-robin deal (None without stats)."""
    imbalance_after: Optional[float]
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
    pp_size: int = 1
    """Pipeline stages: a rank's cost is its packs' ``balance.pipelined_cost`` (the plain sum at 1)."""


class StepPlanner:
    """Deterministic steps over epochs of packs ordered by ``epoch_order(epoch)`` (module docstring).

    ``stats`` (the packs' token counts, ``pack_stats``) is needed by a token budget and by
    balancing; without it (the fixed count dealt round-robin) no imbalance is reported."""

    def __init__(self, stats: Optional[PackStats], epoch_order: Callable[[int], np.ndarray], rule: StepRule):
        if stats is None and (rule.global_batch_tokens is not None or rule.balance == "dp"):
            raise ValueError("StepPlanner: a token budget or packing.balance=dp needs the packs' stats (pack_stats)")
        self.stats, self.epoch_order, self.rule = stats, epoch_order, rule
        self.num_packs = len(epoch_order(0))
        self.costs = None if stats is None else stats.cost(rule.cost_a, rule.cost_b)
        self.budget_tokens = None if stats is None else (
            stats.target_tokens if rule.budget_kind == "target" else stats.real_tokens)
        self.left_out: dict[int, int] = {}
        """Packs each epoch left out (epoch -> count), for the log and tests."""

    @property
    def packs_per_epoch(self) -> int:
        """Packs one epoch trains: the fixed count's cut to a multiple of the DP size; the budget's
        whole order (its left-out tail varies with the epoch)."""
        if self.rule.global_batch_tokens is None:
            return self.num_packs - self.num_packs % self.rule.dp_size
        return self.num_packs

    def steps(self, epoch: int, consumed: int) -> Iterator[StepPlan]:
        """Steps from the resume point on, epoch after epoch (endless)."""
        if self.rule.global_batch_tokens is None:
            return self._fixed_steps(epoch, consumed)
        return self._budget_steps(epoch, consumed)

    def num_steps(self, num_epochs: int) -> int:
        """Steps of the first ``num_epochs`` epochs (``train.num_epochs``): whole fixed-count steps of
        their packs, or every budget step that fits in each of them. Example: 103 packs, dp 2,
        global batch 8, 2 epochs -> 2 * 102 // 8 = 25 steps."""
        if self.rule.global_batch_tokens is None:
            return num_epochs * self.packs_per_epoch // self.rule.global_batch_size
        count = 0
        for epoch in range(num_epochs):
            cumulative, consumed = np.cumsum(self.budget_tokens[self.epoch_order(epoch)]), 0
            while (size := self._budget_size(cumulative, consumed)) is not None:
                consumed, count = consumed + size, count + 1
        return count

    def _fixed_steps(self, epoch: int, consumed: int) -> Iterator[StepPlan]:
        """Steps of the next ``global_batch_size`` packs of the epoch orders, each cut to a multiple of
        the DP size. The deal is round-robin by position in the epoch (pack ``k`` of an epoch to rank
        ``k % dp``), which is the round-robin of the step whenever the step is a multiple of dp."""
        want, parts, have, first = self.rule.global_batch_size, [], 0, consumed
        while True:
            order = self.epoch_order(epoch)
            dealt = self.packs_per_epoch
            self.left_out.setdefault(epoch, len(order) - dealt)
            while consumed < dealt:
                take = min(want - have, dealt - consumed)
                parts.append(order[consumed:consumed + take])
                consumed, have = consumed + take, have + take
                if have == want:
                    end = (epoch, consumed) if consumed < dealt else (epoch + 1, 0)
                    yield self._deal(np.concatenate(parts), end, first=first)
                    parts, have, first = [], 0, end[1]
            epoch, consumed = epoch + 1, 0

    def _budget_steps(self, epoch: int, consumed: int) -> Iterator[StepPlan]:
        while True:
            order = self.epoch_order(epoch)
            cumulative = np.cumsum(self.budget_tokens[order])
            while (size := self._budget_size(cumulative, consumed)) is not None:
                packs = order[consumed:consumed + size]
                consumed += size
                yield self._deal(packs, (epoch, consumed))
            self._leave_out(epoch, len(order) - consumed)
            epoch, consumed = epoch + 1, 0

    def _budget_size(self, cumulative: np.ndarray, consumed: int) -> Optional[int]:
        """Packs of the next budget step after ``consumed`` packs of an epoch (``cumulative``: its
        running budget tokens), or None when the rest of the epoch cannot meet the budget."""
        r = self.rule
        base = int(cumulative[consumed - 1]) if consumed else 0
        reach = int(np.searchsorted(cumulative, base + r.global_batch_tokens)) + 1 - consumed  # packs to the budget
        size = max(reach, r.dp_size)
        if consumed + size > len(cumulative) or int(cumulative[consumed + size - 1]) - base < r.global_batch_tokens:
            return None
        return size

    def _deal(self, packs: np.ndarray, end: tuple[int, int], first: int = 0) -> StepPlan:
        """The step of ``packs``, dealt round-robin from epoch position ``first`` (rank ``r`` takes the
        packs at positions ``= r mod dp``) or balanced by cost."""
        dp = self.rule.dp_size
        by_position = round_robin(len(packs), dp)
        before = [by_position[(r - first) % dp] for r in range(dp)]
        if self.costs is None:
            return StepPlan(packs=packs, per_rank=[packs[a] for a in before], tokens=None, imbalance_before=None,
                            imbalance_after=None, end=end)
        costs = self.costs[packs]
        pp = self.rule.pp_size
        after = assign_balanced(costs, dp, pp) if self.rule.balance == "dp" else before
        return StepPlan(packs=packs, per_rank=[packs[a] for a in after],
                        tokens=int(self.budget_tokens[packs].sum()), imbalance_before=imbalance(costs, before, pp),
                        imbalance_after=imbalance(costs, after, pp), end=end)

    def _leave_out(self, epoch: int, count: int) -> None:
        if epoch not in self.left_out:
            self.left_out[epoch] = count
            if count:
                log.info("epoch %d: the last %d packs of its order do not fill a step; they are left out of this "
                         "epoch (the next epoch's order is another permutation)", epoch, count)


class _PlannedSampler(Sampler[int]):
    """This rank's pack indices of successive planned steps, from the loader's resume point."""

    def __init__(self, loader: "StepLoader"):
        self.loader = loader

    def __iter__(self) -> Iterator[int]:
        # the resume point is read now, when the DataLoader iterator is made, not at its first
        # next() (a generator body runs late: after begin_step() has already moved the point)
        plans, rank = self.loader.planner.steps(*self.loader.position), self.loader.dp_rank
        return (int(pack) for plan in plans for pack in plan.per_rank[rank])


class StepLoader:
    """THD batches of planned steps for one DP rank: a ``protocol.BatchLoader``; ``begin_step()``
    before each step's micro-batches.

    Wraps a ``DataLoader(dataset, sampler=<this rank's planned packs>, batch_size=None,
    collate_fn=...)``: the dataset's item is one pack (a list of samples) and ``collate_fn`` turns
    it into one THD batch, in the worker processes when ``num_workers > 0``. The resume point moves
    with ``begin_step()``, never with worker prefetch.
    """

    def __init__(self, dataset: Any, collate_fn: Callable, planner: StepPlanner, *, dp_rank: int, seed: int,
                 num_workers: int = 0, pin_memory: bool = False, info: LoaderInfo = LoaderInfo(),
                 bucket_order: str = "interleave"):
        self.planner, self.dp_rank, self.seed, self.info = planner, dp_rank, seed, info
        self.bucket_order = bucket_order
        """``packing.bucket_order`` of the planner's epoch order (a resume must keep it)."""
        self.position = (0, 0)
        """(epoch, packs of its order planned into begun steps)."""
        # its own generator: a DataLoader iterator otherwise draws its workers' base seed from the global
        # torch RNG, and a resumed run makes its iterator after restoring the RNG: the draw would shift
        # every later dropout mask against the uninterrupted run (collate draws nothing)
        kwargs: dict[str, Any] = {"pin_memory": pin_memory,  # the caller passes the run's device: True only on a GPU
                                  "generator": torch.Generator().manual_seed(0)}
        if num_workers > 0:
            kwargs["prefetch_factor"] = 2
        self._loader = DataLoader(dataset, batch_size=None, sampler=_PlannedSampler(self), collate_fn=collate_fn,
                                  num_workers=num_workers, **kwargs)
        self._plans: Optional[Iterator[StepPlan]] = None

    def __iter__(self) -> Iterator[dict]:
        self._plans = self.planner.steps(*self.position)
        return iter(self._loader)

    def begin_step(self) -> StepInfo:
        """Plan the next step; afterwards ``state_dict()`` resumes after it."""
        if self._plans is None:
            raise RuntimeError("StepLoader.begin_step() before iter(loader)")
        plan = next(self._plans)
        self.position = plan.end
        return StepInfo(num_microbatches=len(plan.per_rank[self.dp_rank]), tokens=plan.tokens,
                        imbalance_before=plan.imbalance_before, imbalance_after=plan.imbalance_after)

    @property
    def epoch(self) -> float:
        epoch, consumed = self.position
        return epoch + min(consumed / self.packs_per_epoch, 1.0)

    @property
    def packs_per_epoch(self) -> int:
        return self.planner.packs_per_epoch

    def num_steps(self, num_epochs: int) -> int:
        return self.planner.num_steps(num_epochs)

    def state_dict(self) -> dict:
        r = self.planner.rule
        return {"version": STATE_VERSION, "kind": "steps", "epoch": self.position[0], "consumed": self.position[1],
                "num_packs": self.planner.num_packs, "seed": self.seed, "dp_size": r.dp_size,
                "global_batch_tokens": r.global_batch_tokens, "balance": r.balance,
                "bucket_order": self.bucket_order}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state`` (before ``iter``); also reads the state of the fixed-batch sampler of
        earlier versions (``sampler.PackSampler``: the same resume point)."""
        if state.get("kind") is None and "drop_last" in state:  # PackSampler's: a fixed count dealt round-robin
            state = {"kind": "steps", "global_batch_tokens": None, "balance": "none", **state}
        if state.get("version") != STATE_VERSION or state.get("kind") != "steps":
            raise ValueError(f"loader state {dict(state)!r} was not written by an offline loader (a prepared plan or "
                             "packing.mode=in_batch); resume with the packing.mode it was written with, or start "
                             "without checkpoint.load.")
        # the resume point is global (a position in the epoch's order), so another dp_size resumes too
        mine = self.state_dict()
        for key in ("num_packs", "seed", "global_batch_tokens", "balance", "bucket_order"):
            if state.get(key, "interleave" if key == "bucket_order" else None) != mine[key]:
                raise ValueError(f"loader state from the checkpoint has {key}={state.get(key)!r} but this run has "
                                 f"{mine[key]!r}; resume with the same dataset, train.seed, train.global_batch_tokens, "
                                 "packing.balance and packing.bucket_order, or start without checkpoint.load.")
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.planner.num_packs:
            raise ValueError(f"loader state consumed={consumed} is outside [0, num_packs={self.planner.num_packs}].")
        self.position = (int(state["epoch"]), consumed)
        self._plans = None
