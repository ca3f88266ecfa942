"""Which data-parallel rank trains which pack of a global batch, so the slowest rank waits least.

Each DP rank runs its packs one after the other and the optimizer step waits for the slowest
rank. A pack's cost is modelled as ``a * real tokens + b * sum of squared sub-sequence lengths``
(linear layers scale with tokens, causal attention with each sub-sequence's length squared).
``DEFAULT_COST_A`` / ``DEFAULT_COST_B`` (config/choices.py) were fitted by ``python bench/balance.py --fit`` (least
squares of measured forward+backward time per pack; docs/benchmarks.md) and are overridden by
``packing.cost_a`` / ``packing.cost_b``.

``assign_balanced`` gives every rank ``n // dp`` or ``n // dp + 1`` packs (the same counts as
dealing them round-robin), longest-processing-time first, then swaps packs between the most
loaded rank and the others while that lowers the maximum. Worked example, costs
``[8, 7, 6, 5, 4, 3, 2, 1]`` on 2 ranks::

    round-robin: rank 0 {8, 6, 4, 2} = 20, rank 1 {7, 5, 3, 1} = 16 -> max/mean 20/18 = 1.11
    balanced:    rank 0 {8, 5, 4, 1} = 18, rank 1 {7, 6, 3, 2} = 18 -> max/mean 1.00

Each rank's packs are ordered by cost, longest first, so micro-batch slot ``k`` holds packs of
similar cost on every rank. Same costs, same assignment (ties go to the lower index / rank).

With pipeline stages (``pp_size`` > 1) a rank's step is not the sum of its packs: under 1F1B the
first micro-batch fills the pipeline and the last drains it, each crossing all ``pp`` stages, so
a rank of micro-batch costs ``c`` (whole-model cost, ``c / pp`` per stage) takes about
``(sum(c) + (pp - 1) * max(c)) / pp`` (``pipelined_cost``). The same worked example at PP=4::

    round-robin: rank 0 {8, 6, 4, 2}: (20 + 3 * 8) / 4 = 11.00, rank 1 {7, 5, 3, 1}: (16 + 3 * 7) / 4 = 9.25
    by sums:     rank 0 {8, 5, 4, 1}: (18 + 3 * 8) / 4 = 10.50, rank 1 {7, 6, 3, 2}: (18 + 3 * 7) / 4 = 9.75
    pipelined:   rank 0 {8, 5, 3, 1}: (17 + 3 * 8) / 4 = 10.25, rank 1 {7, 6, 4, 2}: (19 + 3 * 7) / 4 = 10.00

(the rank holding the largest pack takes less of the rest).

``assign_balanced(costs, dp, pp)`` runs the same search on the pipelined cost and returns the
deal with the lowest largest pipelined cost of three: its own, the deal balanced by plain sums,
and round-robin; so it is never worse than either (at PP=1 the first two are one deal; the search
alone is, rarely, worse than round-robin: 29 of 20,000 random cases, e.g. ``LPT_WORSE_THAN_ROUND_ROBIN``
in tests/unit/test_balance.py, and there round-robin's deal is taken).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_pack.config.choices import DEFAULT_COST_A, DEFAULT_COST_B

MAX_SWAP_ROUNDS = 64


def pack_cost(seqlens: Sequence[int] | np.ndarray, a: float = DEFAULT_COST_A, b: float = DEFAULT_COST_B) -> float:
    """``a * sum(seqlens) + b * sum(seqlens**2)`` for one pack's real sub-sequence lengths."""
    x = np.asarray(seqlens, dtype=np.float64)
    return float(a * x.sum() + b * (x * x).sum())


def round_robin(num_packs: int, dp_size: int) -> list[np.ndarray]:
    """The unbalanced deal: rank ``r`` takes packs ``r, r + dp, r + 2dp, ...`` of the step."""
    return [np.arange(r, num_packs, dp_size, dtype=np.int64) for r in range(dp_size)]


def rank_loads(costs: np.ndarray, assignment: list[np.ndarray], pp_size: int = 1) -> np.ndarray:
    """Per rank, ``pipelined_cost`` of its packs (the plain sum at ``pp_size`` 1)."""
    costs = np.asarray(costs, dtype=np.float64)
    return np.array([pipelined_cost(costs[a], pp_size) for a in assignment], dtype=np.float64)


def pipelined_cost(costs: Sequence[float] | np.ndarray, pp_size: int = 1) -> float:
    """A rank's step under 1F1B over ``pp_size`` stages, for micro-batches of whole-model ``costs``:
    ``(sum + (pp - 1) * max) / pp`` (the largest micro-batch fills and drains the pipeline). Example:
    ``[4, 2, 2]`` at PP=2 -> ``(8 + 4) / 2 = 6``; at PP=1 the sum, 8."""
    x = np.asarray(costs, dtype=np.float64)
    if pp_size == 1 or x.size == 0:
        return float(x.sum())
    return float((x.sum() + (pp_size - 1) * x.max()) / pp_size)


def imbalance(costs: np.ndarray, assignment: list[np.ndarray], pp_size: int = 1) -> float:
    """Max over mean of the per-rank (pipelined) cost (1.0 is perfect; 1.0 when nothing costs anything)."""
    loads = rank_loads(costs, assignment, pp_size)
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def assign_balanced(costs: Sequence[float] | np.ndarray, dp_size: int, pp_size: int = 1) -> list[np.ndarray]:
    """Per rank, the step's pack indices in micro-batch slot order, minimising the largest rank cost
    (``pipelined_cost`` at ``pp_size`` stages).

    Every index ``0 .. n-1`` appears exactly once; rank ``r`` gets ``n // dp`` packs, plus one for
    the first ``n % dp`` ranks (as ``round_robin``). Never worse than round-robin, nor (at PP>1) than
    the deal balanced by plain sums.
    """
    costs = np.asarray(costs, dtype=np.float64)
    candidates = [_search(costs, dp_size, pp_size)]
    if pp_size > 1:
        candidates.append(_search(costs, dp_size, 1))
    candidates.append([a.tolist() for a in round_robin(len(costs), dp_size)])
    worst = [rank_loads(costs, [np.asarray(m, dtype=np.int64) for m in c], pp_size).max(initial=0.0)
             for c in candidates]
    members = candidates[int(np.argmin(worst))]  # the first of equals: the search's own deal
    return [np.asarray(sorted(m, key=lambda i: (-costs[i], i)), dtype=np.int64) for m in members]


def _search(costs: np.ndarray, dp_size: int, pp_size: int) -> list[list[int]]:
    """Longest-processing-time first under the round-robin counts, then swaps (module docstring).
    ``loads`` are ``pp * pipelined_cost``: the sum plus ``(pp - 1)`` times the largest pack."""
    n = len(costs)
    caps = np.array([n // dp_size + (r < n % dp_size) for r in range(dp_size)])
    loads = np.zeros(dp_size)
    largest = np.zeros(dp_size)
    members: list[list[int]] = [[] for _ in range(dp_size)]
    for i in np.argsort(-costs, kind="stable").tolist():
        open_ranks = np.flatnonzero(np.array([len(m) for m in members]) < caps)
        raised = (pp_size - 1) * np.maximum(costs[i] - largest[open_ranks], 0.0)  # zero at PP=1
        r = int(open_ranks[np.argmin(loads[open_ranks] + raised)])
        members[r].append(i)
        loads[r] += costs[i] + (pp_size - 1) * max(costs[i] - largest[r], 0.0)
        largest[r] = max(largest[r], costs[i])
    _improve_by_swaps(costs, members, loads, pp_size)
    return members


def _without_each_max(x: np.ndarray) -> np.ndarray:
    """For each element of ``x``, the largest of the others (``-inf`` when none). [3, 5, 5] -> [5, 5, 5]."""
    if x.size < 2:
        return np.full(x.size, -np.inf)
    order = np.argsort(-x, kind="stable")
    out = np.full(x.size, x[order[0]])
    out[order[0]] = x[order[1]]
    return out


def _improve_by_swaps(costs: np.ndarray, members: list[list[int]], loads: np.ndarray, pp_size: int = 1) -> None:
    """Swap one pack of the most loaded rank with one of another rank while that lowers the pair's max.
    At PP>1 a swap also moves each rank's largest pack, which the ``(pp - 1) * max`` term follows."""
    for _ in range(MAX_SWAP_ROUNDS):
        top = int(np.argmax(loads))
        best = None  # (new pair max, rank, i in top, j in other, new top load, new other load)
        for r in range(len(members)):
            if r == top:
                continue
            a = costs[members[top]][:, None]
            b = costs[members[r]][None, :]
            if a.size == 0 or b.size == 0:
                continue
            delta = a - b  # moving i out of top and j in lowers top's sum by delta
            new_top, new_r = loads[top] - delta, loads[r] + delta
            if pp_size > 1:
                rest_top, rest_r = _without_each_max(a[:, 0])[:, None], _without_each_max(b[0])[None, :]
                new_top = new_top + (pp_size - 1) * (np.maximum(rest_top, b) - a.max())
                new_r = new_r + (pp_size - 1) * (np.maximum(rest_r, a) - b.max())
            pair_max = np.maximum(new_top, new_r)
            k = int(np.argmin(pair_max))
            value = float(pair_max.flat[k])
            if value < loads[top] - 1e-12 and (best is None or value < best[0]):
                ii, jj = k // b.shape[1], k % b.shape[1]
                best = (value, r, ii, jj, float(new_top[ii, jj]), float(new_r[ii, jj]))
        if best is None:
            return
        _, r, ii, jj, load_top, load_r = best
        members[top][ii], members[r][jj] = members[r][jj], members[top][ii]
        loads[top], loads[r] = load_top, load_r
