"""Packing plans: which samples share a pack, computed on the length histogram.

A plan answers one question: given the padded THD length of every sample and a pack capacity,
which samples go into which pack (bin). It never looks at token values.

Every sample's length is an integer in ``[1, capacity]``, so there are at most ``capacity``
distinct lengths. The decreasing algorithms (``bfd``, ``ffd``) place all samples of one length
at once: ``k`` samples of length ``L`` go into the open bins in the order the algorithm prefers,
each bin taking ``min(remaining // L, samples left)`` of them. The work is O(capacity * bins
touched) numpy steps plus two O(N) passes, so 10M lengths plan in a fraction of a second.

Worked example (``bfd``, capacity 8, lengths ``[5, 4, 3, 2, 2]``)::

    length 5: no open bin fits -> open bin 0 (remaining 3)
    length 4: no open bin fits -> open bin 1 (remaining 4)
    length 3: the best (smallest remaining >= 3) is bin 0 -> remaining 0
    length 2 (x2): the best is bin 1 (remaining 4), which takes 4 // 2 = 2 of them -> remaining 0
    bins: {0: [5, 3], 1: [4, 2, 2]}   (sample indices [0, 2] and [1, 3, 4])

The best-fit rule is written once, here, for the offline plan and the online packer's buffer
(``data/packing/online.py`` calls ``best_fit_decreasing``): samples longest first (equal lengths
by index), each into the open bin with the least room that still fits it; among bins with equal
room, the one that has had that room the longest (the first to reach it); with ``max_items`` a bin
holding that many samples is closed. Up to ``SMALL_PLAN`` samples the rule runs sample by sample
(faster on a small buffer); above, on the histogram. Both give the same plan, array for array
(tests/unit/test_bfd_rule.py).
"""

from __future__ import annotations

import bisect
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from megatron_pack.config.choices import PACKING_ALGORITHMS
from megatron_pack.config.layout import round_up

ALGORITHMS = PACKING_ALGORITHMS
"""``packing.algorithm`` values; the list lives in ``megatron_pack.config.choices``."""
BIN_PACKING_ALGORITHMS = tuple(a for a in ALGORITHMS if a != "wrapped")
"""The algorithms ``plan_packing`` runs: bins of whole samples (``wrapped`` cuts samples: ``packing.wrapped``)."""
SMALL_PLAN = 2048
"""Up to this many samples best fit runs sample by sample: on a small buffer it is 10-60x faster than the
histogram planner, whose cost grows with the capacity (4096-token packs, 64-2048 samples, measured)."""


def thd_lengths(num_ids, pad_multiple: int = 1) -> np.ndarray:
    """Padded THD length of each sample: ``len(ids) - 1`` rounded up to ``pad_multiple``.

    A sample of ``n`` ids contributes ``n - 1`` (token, label) positions to a pack, padded to
    the pad multiple so that CP can cut it into ``2 * CP`` equal chunks.
    Example: ``thd_lengths([5, 9, 1], 4) -> [4, 8, 0]``.
    """
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple ({pad_multiple}) must be >= 1.")
    n = np.asarray(num_ids, dtype=np.int64) - 1
    if n.size and n.min() < 0:
        raise ValueError("every sample needs at least one id; got a sample with 0 ids.")
    return round_up(n, pad_multiple)


@dataclass(frozen=True)
class PackingPlan:
    """Bins of sample indices.

    ``order`` lists sample indices bin after bin; bin ``b`` is ``order[bin_offsets[b]:bin_offsets[b+1]]``.
    """

    order: np.ndarray
    """[num_samples] sample indices (int32 when they fit, else int64), grouped by bin."""
    bin_offsets: np.ndarray
    """int64 [num_bins + 1]: start of each bin in ``order``; last entry is num_samples."""
    lengths: np.ndarray
    """int64 [num_samples]: the (padded) length of every sample, indexed by sample index."""
    capacity: int
    """Pack capacity in tokens."""

    @property
    def num_bins(self) -> int:
        return len(self.bin_offsets) - 1

    def bins(self) -> list[np.ndarray]:
        """One integer array of sample indices per bin."""
        return np.split(self.order, self.bin_offsets[1:-1]) if self.num_bins else []

    def bin_loads(self) -> np.ndarray:
        """Sum of lengths in each bin (int64 [num_bins])."""
        if self.num_bins == 0:
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(self.lengths[self.order], self.bin_offsets[:-1])

    def bin_sizes(self) -> np.ndarray:
        """Number of samples in each bin."""
        return np.diff(self.bin_offsets)

    @property
    def lower_bound(self) -> int:
        """``ceil(sum(lengths) / capacity)``: no plan can use fewer bins."""
        return lower_bound_bins(self.lengths, self.capacity)

    @property
    def efficiency(self) -> float:
        """Share of pack tokens filled by sample tokens: ``sum(lengths) / (num_bins * capacity)``."""
        if self.num_bins == 0:
            return 0.0
        return float(self.lengths.sum()) / (self.num_bins * self.capacity)


def lower_bound_bins(lengths, capacity: int) -> int:
    """``ceil(sum(lengths) / capacity)``."""
    return int(math.ceil(int(np.asarray(lengths, dtype=np.int64).sum()) / capacity))


def plan_packing(lengths, capacity: int, algorithm: str = "bfd", seed: int = 0,
                 max_items: int | None = None) -> PackingPlan:
    """Assign every sample to a bin so no bin's total length exceeds ``capacity``.

    ``lengths`` are the padded THD lengths (see ``thd_lengths``), each in ``[1, capacity]``.
    Algorithms: ``bfd`` (exact best-fit decreasing, the rule in the module docstring),
    ``ffd`` (first-fit decreasing), ``first_fit_shuffle`` (seeded shuffle, then first fit),
    ``sequential`` (next fit in input order). The bin order is shuffled with ``seed``, except for
    ``sequential``, which keeps the input order. ``max_items`` (``bfd`` only) closes a bin once it
    holds that many samples. Same inputs, same plan.

    >>> plan = plan_packing([4, 2, 3, 3], 6)
    >>> plan.num_bins, plan.efficiency
    (2, 1.0)
    """
    lengths = _checked_lengths(lengths, capacity, algorithm)
    if max_items is not None and (algorithm != "bfd" or max_items < 1):
        raise ValueError(f"max_items ({max_items}) caps the samples of a bfd bin; it needs algorithm='bfd' "
                         f"(got {algorithm!r}) and a positive count.")
    if lengths.size == 0:
        return PackingPlan(np.zeros(0, np.int64), np.zeros(1, np.int64), lengths, capacity)
    if algorithm == "sequential":
        order, offsets = _sequential(lengths, capacity)
        return PackingPlan(order, offsets, lengths, capacity)
    if algorithm in ("bfd", "ffd"):
        order, offsets = _decreasing_plan(lengths, capacity, best_fit=algorithm == "bfd", max_items=max_items,
                                          renumber=lambda num_bins: np.random.default_rng(seed).permutation(num_bins))
    else:
        order, offsets = _shuffle_bins(*_first_fit_shuffle(lengths, capacity, seed), seed)
    return PackingPlan(order, offsets, lengths, capacity)


def best_fit_decreasing(lengths, capacity: int, max_items: int | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """The ``bfd`` bins of ``plan_packing`` in the order they were opened (no seeded shuffle), as
    (sample index arrays, loads); each bin lists its samples in the order they were placed.

    >>> bins, loads = best_fit_decreasing([5, 4, 3, 2, 2], 8)
    >>> [b.tolist() for b in bins], loads.tolist()
    ([[0, 2], [1, 3, 4]], [8, 8])
    >>> bins, loads = best_fit_decreasing([5, 4, 3, 2, 2], 8, max_items=2)
    >>> [b.tolist() for b in bins], loads.tolist()
    ([[0, 2], [1, 3], [4]], [8, 6, 2])
    """
    lengths = _checked_lengths(lengths, capacity, "bfd")
    if max_items is not None and max_items < 1:
        raise ValueError(f"max_items ({max_items}) must be a positive count (packing.max_samples_per_pack).")
    if lengths.size == 0:
        return [], np.zeros(0, np.int64)
    if len(lengths) <= SMALL_PLAN:  # the online buffer's usual size: no plan arrays in between
        bins = [np.asarray(m, dtype=np.int64) for m in _best_fit_by_sample(lengths, capacity, max_items)]
        return bins, np.array([int(lengths[b].sum()) for b in bins], dtype=np.int64)
    order, offsets = _decreasing_plan(lengths, capacity, best_fit=True, max_items=max_items,
                                      renumber=lambda num_bins: np.arange(num_bins))
    plan = PackingPlan(order, offsets, lengths, capacity)
    return plan.bins(), plan.bin_loads()


def _decreasing_plan(lengths: np.ndarray, capacity: int, *, best_fit: bool, max_items: int | None,
                     renumber) -> tuple[np.ndarray, np.ndarray]:
    """``(order, bin_offsets)`` of best / first fit decreasing; ``renumber(num_bins)`` gives each bin
    (in opening order) its place in the plan."""
    if best_fit and len(lengths) <= SMALL_PLAN:
        return _bins_to_order(_best_fit_by_sample(lengths, capacity, max_items), renumber)
    with ThreadPoolExecutor(1) as pool:  # the sort releases the GIL: overlap it with the planning
        by_length = pool.submit(_longest_first, lengths)
        fill, events = _decreasing(lengths, capacity, best_fit=best_fit, max_items=max_items)
        return _materialize(events, fill, renumber(len(fill)), by_length)


def _best_fit_by_sample(lengths: np.ndarray, capacity: int, max_items: int | None) -> list[list[int]]:
    """The bfd rule one sample at a time: bins (in opening order) of sample indices (in placement order).

    ``room`` is sorted by (room left, when the bin got that room, bin): the first entry with
    enough room is the best fit, and among equal rooms the bin that has had it the longest.
    """
    shortest = int(lengths.min())
    room: list[tuple[int, int, int]] = []
    members: list[list[int]] = []
    for clock, i in enumerate(_longest_first(lengths).tolist()):
        need = int(lengths[i])
        at = bisect.bisect_left(room, (need, -1, -1))
        if at == len(room):
            b, left = len(members), capacity
            members.append([])
        else:
            left, _, b = room.pop(at)
        members[b].append(i)
        left -= need
        if left >= shortest and (max_items is None or len(members[b]) < max_items):
            bisect.insort(room, (left, clock, b))
    return members


def _bins_to_order(members: list[list[int]], renumber) -> tuple[np.ndarray, np.ndarray]:
    """``(order, bin_offsets)`` with bin ``b`` (opening order) placed at ``renumber(num_bins)[b]``."""
    new_id = np.asarray(renumber(len(members)))
    placed = [members[b] for b in np.argsort(new_id)]
    offsets = np.zeros(len(members) + 1, dtype=np.int64)
    np.cumsum([len(m) for m in placed], out=offsets[1:])
    index_dtype = np.int32 if offsets[-1] < 2**31 else np.int64
    return np.fromiter((i for m in placed for i in m), dtype=index_dtype, count=int(offsets[-1])), offsets


def _checked_lengths(lengths, capacity: int, algorithm: str) -> np.ndarray:
    if algorithm == "wrapped":
        raise ValueError("packing algorithm 'wrapped' cuts samples at row ends, so it is not a bin packing of whole "
                         "samples: use megatron_pack.data.packing.wrapped.wrapped_entries (prepare does), or choose "
                         "bfd, ffd, first_fit_shuffle or sequential here.")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"packing algorithm {algorithm!r} is unknown; choose one of {list(ALGORITHMS)} "
                         "(packing.algorithm).")
    if not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity ({capacity!r}) must be a positive integer (packing.packed_sequence_size).")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional; got shape {lengths.shape}.")
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        bad = int(np.flatnonzero((lengths < 1) | (lengths > capacity))[0])
        raise ValueError(f"sample {bad} has length {int(lengths[bad])}, outside [1, capacity={capacity}]; "
                         "drop or truncate over-long samples before planning (packing.on_overflow).")
    return lengths


def _longest_first(lengths: np.ndarray) -> np.ndarray:
    """Sample indices by decreasing length, increasing index within a length (a radix sort)."""
    top = int(lengths.max())
    key = np.subtract(top, lengths, dtype=np.uint16 if top < 2**16 else np.int64, casting="unsafe")
    return np.argsort(key, kind="stable")


def _materialize(events: list, fill: np.ndarray, new_id: np.ndarray, by_length) -> tuple[np.ndarray, np.ndarray]:
    """Turn per-length placement events into ``(order, bin_offsets)`` with a few O(N) passes.

    Each event ``(L, bins, starts, counts)`` says: bin ``bins[j]`` receives ``counts[j]`` samples
    of length ``L`` at slots ``starts[j] ...`` inside the bin. Samples of one length are handed
    out in increasing index order (``by_length``, a future of ``_longest_first``), event after
    event. ``new_id`` renumbers the bins (the seeded bin shuffle), so shuffling costs nothing extra.

    Example: lengths [5, 4, 3, 2, 2], events (5: bin 0 x1), (4: bin 1 x1), (3: bin 0 x1 at slot 1),
    (2: bin 1 x2 at slot 1), no renumbering: samples by length are [0, 1, 2, 3, 4], slots
    [0, 2, 1, 3, 4], so order = [0, 2, 1, 3, 4] and bin_offsets = [0, 2, 5].
    """
    old_id = np.empty_like(new_id)
    old_id[new_id] = np.arange(len(new_id))
    offsets = np.zeros(len(fill) + 1, dtype=np.int64)
    np.cumsum(fill[old_id], out=offsets[1:])
    counts = np.concatenate([e[3] for e in events])
    first = offsets[new_id[np.concatenate([e[1] for e in events])]] + np.concatenate([e[2] for e in events])
    run_start = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=run_start[1:])
    num_samples = int(offsets[-1])
    index_dtype = np.int32 if num_samples < 2**31 else np.int64
    slots = np.repeat((first - run_start).astype(index_dtype), counts)
    slots += np.arange(num_samples, dtype=index_dtype)
    order = np.empty(num_samples, dtype=index_dtype)
    order[slots] = by_length.result()
    return order, offsets


def _decreasing(lengths: np.ndarray, capacity: int, *, best_fit: bool,
                max_items: int | None = None) -> tuple[np.ndarray, list]:
    """Exact best-fit / first-fit decreasing, one length at a time (largest first).

    Returns the number of samples in each bin and the placement events (see ``_materialize``).
    """
    histogram = np.bincount(lengths, minlength=capacity + 1)
    present = np.flatnonzero(histogram)
    scale = int(np.gcd.reduce(np.append(present, capacity)))
    if scale > 1:  # e.g. lengths padded to a multiple: plan in units of that multiple
        histogram, capacity = histogram[::scale], capacity // scale
    # Any-fit plans never leave two bins at most half full, so they use <= 2 * lower bound + 1 bins
    # (a cap on samples per bin voids that bound: as many bins as samples, at most).
    max_bins = min(len(lengths), 2 * int(math.ceil(int(histogram @ np.arange(len(histogram))) / capacity)) + 2)
    if max_items is not None:
        max_bins = len(lengths)
    state = (_BestFitBins(capacity, max_bins, max_items) if best_fit else
             _FirstFitBins(capacity, max_bins, int(present[0]) // scale))
    events: list = []
    half = capacity // 2  # samples longer than half the capacity never share a bin: one event for all
    singles = np.repeat(np.arange(capacity, half, -1), histogram[capacity:half:-1])
    if singles.size:
        state.open_singletons(singles, events)
    for length in np.flatnonzero(histogram[:half + 1])[::-1].tolist():
        k = state.fill(length, int(histogram[length]), events)
        if k:
            state.open_new(length, k, events)
    return state.count[:state.num_bins], events


class _Bins:
    """Sample count of every bin, and opening new bins for samples no open bin can take.

    Subclasses track the remaining space of bins (``_placed``) and choose bins (``fill``)."""

    def __init__(self, capacity: int, max_bins: int):
        self.capacity = capacity
        self.count = np.zeros(max_bins, dtype=np.int64)
        self.num_bins = 0

    def _record(self, length: int, bins: np.ndarray, take, events: list) -> None:
        if not isinstance(take, np.ndarray):
            take = np.full(bins.shape, take, dtype=np.int64)
        events.append((length, bins, self.count[bins], take))
        self.count[bins] += take

    def open_singletons(self, lengths: np.ndarray, events: list) -> None:
        """One new bin per sample, for samples (longest first) that no other sample can join."""
        new = np.arange(self.num_bins, self.num_bins + lengths.size, dtype=np.int64)
        self._record(0, new, 1, events)
        self.num_bins += lengths.size
        self._placed(new, self.capacity - lengths)

    max_items: int | None = None

    def open_new(self, length: int, k: int, events: list) -> None:
        per_bin = self.capacity // length if self.max_items is None else min(self.capacity // length, self.max_items)
        num_new = -(-k // per_bin)
        new = np.arange(self.num_bins, self.num_bins + num_new, dtype=np.int64)
        take = np.full(num_new, per_bin, dtype=np.int64)
        take[-1] = k - per_bin * (num_new - 1)
        self._record(length, new, take, events)
        self.num_bins += num_new
        self._placed(new, self.capacity - take * length)


class _BestFitBins(_Bins):
    """Bins grouped by remaining space: ``buckets[r]`` holds the ids of bins with ``r`` tokens free.

    Sequential best fit keeps adding samples of one length to the bin it chose (the smallest
    remaining space that fits) until that bin has no room, so the bins of bucket ``r`` each take
    ``r // length`` samples, buckets in increasing ``r``. A second level counts the non-empty
    buckets per block of 64, so finding the next buckets costs O(capacity / 64), not O(capacity).
    """

    BLOCK_BITS = 6

    def __init__(self, capacity: int, max_bins: int, max_items: int | None = None):
        super().__init__(capacity, max_bins)
        self.max_items = max_items
        """Samples that close a bin (None: no cap): a closed bin is in no bucket."""
        self.buckets: list[list[np.ndarray]] = [[] for _ in range(capacity + 1)]
        self.num_in_bucket = np.zeros(capacity + 1, dtype=np.int64)
        self.num_filled_in_block = np.zeros((capacity >> self.BLOCK_BITS) + 1, dtype=np.int64)

    def _pop(self, r: int) -> np.ndarray:
        parts = self.buckets[r]
        self.buckets[r] = []
        self.num_in_bucket[r] = 0
        self.num_filled_in_block[r >> self.BLOCK_BITS] -= 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _push(self, r: int, bins: np.ndarray) -> None:
        if bins.size:
            if not self.buckets[r]:
                self.num_filled_in_block[r >> self.BLOCK_BITS] += 1
            self.buckets[r].append(bins)
            self.num_in_bucket[r] += bins.size

    def _placed(self, bins: np.ndarray, remaining: np.ndarray) -> None:
        if self.max_items is not None:
            still_open = self.count[bins] < self.max_items
            bins, remaining = bins[still_open], remaining[still_open]
            if not bins.size:
                return
        if remaining.size < 2 or remaining[0] == remaining[-2]:  # open_new: all but the last equally full
            self._push(int(remaining[0]), bins[:-1])
            self._push(int(remaining[-1]), bins[-1:])
            return
        by_room = np.argsort(remaining, kind="stable")
        values, starts = np.unique(remaining[by_room], return_index=True)
        for r, group in zip(values.tolist(), np.split(bins[by_room], starts[1:])):
            self._push(r, group)

    def fill(self, length: int, k: int, events: list) -> int:
        first_block = length >> self.BLOCK_BITS
        for block in (np.flatnonzero(self.num_filled_in_block[first_block:]) + first_block).tolist():
            lo = max(block << self.BLOCK_BITS, length)
            hi = min((block + 1) << self.BLOCK_BITS, self.capacity + 1)
            rs = np.flatnonzero(self.num_in_bucket[lo:hi]) + lo
            if rs.size:
                fill = self._fill_buckets if self.max_items is None else self._fill_capped
                k = fill(rs, length, k, events)
                if k == 0:
                    return 0
        return k

    def _fill_buckets(self, rs: np.ndarray, length: int, k: int, events: list) -> int:
        """Fill buckets ``rs`` (increasing) with up to ``k`` samples of ``length``; return how many are left."""
        room = np.cumsum(self.num_in_bucket[rs] * (rs // length))
        num_full = int(np.searchsorted(room, k))  # buckets rs[:num_full] are emptied completely
        for r in rs[:num_full].tolist():
            bins = self._pop(r)
            per_bin = r // length
            self._record(length, bins, per_bin, events)
            self._push(r - per_bin * length, bins)
        k -= int(room[num_full - 1]) if num_full else 0
        if k and num_full < rs.size:
            self._fill_partial(int(rs[num_full]), length, k, events)
            k = 0
        return k

    def _fill_capped(self, rs: np.ndarray, length: int, k: int, events: list) -> int:
        """``_fill_buckets`` with a cap: a bin of bucket ``r`` takes ``min(r // length, max_items - count)``
        samples, one bin after the other, and closes when it reaches the cap."""
        for r in rs.tolist():
            bins = self._pop(r)
            can = np.minimum(r // length, self.max_items - self.count[bins])
            total = np.cumsum(can)
            num_full = int(np.searchsorted(total, k))  # bins[:num_full] take all they can, bins[num_full] the rest
            if num_full >= bins.size:
                self._record(length, bins, can, events)
                self._regroup(bins, r - can * length)
                k -= int(total[-1])
                continue
            take = can[:num_full + 1].copy()
            take[-1] = k - (int(total[num_full - 1]) if num_full else 0)
            used = bins[:num_full + 1]
            self._record(length, used, take, events)
            self._regroup(used, r - take * length)
            self._push(r, bins[num_full + 1:])
            return 0
        return k

    def _regroup(self, bins: np.ndarray, remaining: np.ndarray) -> None:
        """Push each still-open bin to its bucket, in bin order within a bucket (their arrival order)."""
        still_open = self.count[bins] < self.max_items
        bins, remaining = bins[still_open], remaining[still_open]
        by_room = np.argsort(remaining, kind="stable")
        values, starts = np.unique(remaining[by_room], return_index=True)
        for r, group in zip(values.tolist(), np.split(bins[by_room], starts[1:])):
            self._push(r, group)

    def _fill_partial(self, r: int, length: int, k: int, events: list) -> None:
        """Bucket ``r`` has more room than ``k`` samples need: fill its first bins only."""
        bins = self._pop(r)
        per_bin = r // length
        num_full, rest = divmod(k, per_bin)
        if num_full:
            self._record(length, bins[:num_full], per_bin, events)
            self._push(r - per_bin * length, bins[:num_full])
        if rest:
            self._record(length, bins[num_full:num_full + 1], rest, events)
            self._push(r - rest * length, bins[num_full:num_full + 1])
        self._push(r, bins[num_full + (1 if rest else 0):])


class _FirstFitBins(_Bins):
    """Remaining space per bin; ``live`` lists (in bin order) the bins that can still take a sample."""

    def __init__(self, capacity: int, max_bins: int, shortest: int):
        super().__init__(capacity, max_bins)
        self.remaining = np.zeros(max_bins, dtype=np.int64)
        self.live = np.zeros(0, dtype=np.int64)
        self.shortest = shortest

    def _placed(self, bins: np.ndarray, remaining: np.ndarray) -> None:
        self.remaining[bins] = remaining
        self.live = np.concatenate([self.live, bins])

    def fill(self, length: int, k: int, events: list) -> int:
        self.live = self.live[self.remaining[self.live] >= self.shortest]
        cand = self.live[self.remaining[self.live] >= length]  # lowest bin index first
        if cand.size == 0:
            return k
        room = self.remaining[cand] // length
        total = np.cumsum(room)
        n = int(np.searchsorted(total, k))  # bins cand[:n] are filled to the brim
        take = room if n >= cand.size else np.append(room[:n], k - (int(total[n - 1]) if n else 0))
        used = cand[:take.size]
        self._record(length, used, take, events)
        self.remaining[used] -= take * length
        return k - int(take.sum())


def _first_fit_shuffle(lengths: np.ndarray, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle the samples with ``seed``, then first fit (the lowest-index bin with room).

    Sequential by nature. A max-tree over bins finds the leftmost bin with room in
    O(log bins); unused bins hold ``capacity``, so "no open bin fits" lands on the next new one.
    """
    perm = np.random.default_rng(seed).permutation(len(lengths))
    max_bins = 2 * lower_bound_bins(lengths, capacity) + 2  # no two any-fit bins are both half empty
    size = 1 << max(1, (max_bins - 1).bit_length())
    tree = [capacity] * (2 * size)
    bin_of = []
    for length in lengths[perm].tolist():
        i = 1
        while i < size:
            i = 2 * i if tree[2 * i] >= length else 2 * i + 1
        tree[i] -= length
        bin_of.append(i - size)
        i >>= 1
        while i:
            best = max(tree[2 * i], tree[2 * i + 1])
            if tree[i] == best:
                break
            tree[i] = best
            i >>= 1
    bin_of = np.array(bin_of, dtype=np.int64)
    return _group_by_bin(perm, bin_of, int(bin_of.max()) + 1)


def _sequential(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Next fit in input order: start a new bin whenever the next sample does not fit."""
    starts = [0]
    load = 0
    for i, length in enumerate(lengths.tolist()):
        if load + length > capacity:
            starts.append(i)
            load = 0
        load += length
    offsets = np.array(starts + [len(lengths)], dtype=np.int64)
    return np.arange(len(lengths), dtype=np.int64), offsets


def _group_by_bin(items: np.ndarray, bin_of: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Order ``items`` by their bin (stable), returning ``(order, bin_offsets)``."""
    by_bin = np.argsort(bin_of, kind="stable")
    offsets = np.zeros(num_bins + 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of, minlength=num_bins), out=offsets[1:])
    return items[by_bin].astype(np.int64), offsets


def _shuffle_bins(order: np.ndarray, offsets: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Permute whole bins with ``seed`` (samples keep their bin and their order inside it)."""
    perm = np.random.default_rng(seed).permutation(len(offsets) - 1)
    sizes = np.diff(offsets)[perm]
    new_offsets = np.zeros_like(offsets)
    np.cumsum(sizes, out=new_offsets[1:])
    gather = np.repeat(offsets[:-1][perm] - new_offsets[:-1], sizes) + np.arange(len(order), dtype=np.int64)
    return order[gather], new_offsets
