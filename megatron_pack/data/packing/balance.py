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


def rank_loads(costs: np.ndarray, assignment: list[np.ndarray]) -> np.ndarray:
    return np.array([float(np.asarray(costs)[a].sum()) for a in assignment], dtype=np.float64)


def imbalance(costs: np.ndarray, assignment: list[np.ndarray]) -> float:
    """Max over mean of the per-rank cost (1.0 is perfect; 1.0 when nothing costs anything)."""
    loads = rank_loads(costs, assignment)
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def assign_balanced(costs: Sequence[float] | np.ndarray, dp_size: int) -> list[np.ndarray]:
    """Per rank, the step's pack indices in micro-batch slot order, minimising the largest rank cost.

    Every index ``0 .. n-1`` appears exactly once; rank ``r`` gets ``n // dp`` packs, plus one for
    the first ``n % dp`` ranks (as ``round_robin``).
    """
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    caps = np.array([n // dp_size + (r < n % dp_size) for r in range(dp_size)])
    loads = np.zeros(dp_size)
    members: list[list[int]] = [[] for _ in range(dp_size)]
    for i in np.argsort(-costs, kind="stable").tolist():
        open_ranks = np.flatnonzero(np.array([len(m) for m in members]) < caps)
        r = int(open_ranks[np.argmin(loads[open_ranks])])
        members[r].append(i)
        loads[r] += costs[i]
    _improve_by_swaps(costs, members, loads)
    return [np.asarray(sorted(m, key=lambda i: (-costs[i], i)), dtype=np.int64) for m in members]


def _improve_by_swaps(costs: np.ndarray, members: list[list[int]], loads: np.ndarray) -> None:
    """Swap one pack of the most loaded rank with one of another rank while that lowers the pair's max."""
    for _ in range(MAX_SWAP_ROUNDS):
        top = int(np.argmax(loads))
        best = None  # (new pair max, rank, i in top, j in other)
        for r in range(len(members)):
            if r == top:
                continue
            a = costs[members[top]][:, None]
            b = costs[members[r]][None, :]
            if a.size == 0 or b.size == 0:
                continue
            delta = a - b  # moving i out of top and j in lowers top by delta
            pair_max = np.maximum(loads[top] - delta, loads[r] + delta)
            k = int(np.argmin(pair_max))
            value = float(pair_max.flat[k])
            if value < loads[top] - 1e-12 and (best is None or value < best[0]):
                best = (value, r, k // b.shape[1], k % b.shape[1])
        if best is None:
            return
        _, r, ii, jj = best
        i, j = members[top][ii], members[r][jj]
        members[top][ii], members[r][jj] = j, i
        loads[top] += costs[j] - costs[i]
        loads[r] += costs[i] - costs[j]
