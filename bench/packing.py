"""Benchmark: plan packing for 1M and 10M log-normal lengths (mean ~400, capacity 4096).

Prints seconds (best of --repeats), packs, the lower bound ceil(sum/capacity) and efficiency
for our algorithms, and, when ``trl`` is installed, TRL's ``pack_dataset(strategy="bfd")`` on the
same 1M lengths, measured in this run, with the ratios. Targets: 10M planned by ``bfd`` in
< 0.5 s; >= 50x faster than TRL at 1M; packs <= TRL's.

The strategies of issue 17 run beside plain BFD on the same lengths, interleaved in one loop
(best of --repeats each, so machine noise hits both alike): length buckets (``auto``, planned per
bucket), split (lengths not clipped, so the tail above the capacity is cut into pieces with a
256-token overlap, then BFD) and the wrapped stream (documents cut at row ends). Printed: seconds,
packs, efficiency and the time ratio against BFD.

    .venv/bin/python bench/packing.py [--repeats 3] [--no-trl] [--no-strategies]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from megatron_pack.data.packing.algorithms import plan_packing, thd_lengths
from megatron_pack.data.packing.buckets import assign_buckets, bucket_boundaries, plan_buckets
from megatron_pack.data.packing.split import split_entries
from megatron_pack.data.packing.wrapped import wrapped_entries

CAPACITY = 4096


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Log-normal SFT-like lengths, mean about 400 tokens, clipped to [1, CAPACITY]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(400) - 0.5, 1.0, n), 1, CAPACITY).astype(np.int64)


def best_time(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def trl_bfd(lengths: np.ndarray):
    """TRL's pack_dataset(strategy='bfd') over a dataset whose rows have these lengths, in one batch."""
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from trl import pack_dataset

    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array(np.zeros(int(offsets[-1]), dtype=np.int32))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    dataset = Dataset(InMemoryTable(pa.table({"input_ids": column})))
    kwargs = {"batch_size": len(lengths), "keep_in_memory": True}  # pack globally, not per 1000-row batch
    start = time.perf_counter()
    packed = pack_dataset(dataset, CAPACITY, strategy="bfd", map_kwargs=kwargs)
    return time.perf_counter() - start, packed.num_rows


class _AllAnswer:
    """An answer mask of ones, sliced like the token store's (no 4-billion-entry array)."""

    def __getitem__(self, index: slice) -> np.ndarray:
        return np.ones(max(0, index.stop - index.start), dtype=np.uint8)


def plan_buckets_auto(lengths: np.ndarray):
    boundaries = bucket_boundaries("auto", lengths)
    bucket_of = assign_buckets(lengths, boundaries)
    plan, _ = plan_buckets(lengths, bucket_of, len(boundaries) + 1, CAPACITY, "bfd", 0)
    return plan.num_bins, plan.efficiency


def plan_split(raw: np.ndarray, overlap: int = 256):
    """Whole samples that fit, the pieces of the others (``split_entries``), then BFD over all."""
    over = np.flatnonzero(raw > CAPACITY)
    offsets = np.zeros(len(raw) + 1, dtype=np.int64)
    np.cumsum(raw + 1, out=offsets[1:])  # a sample of L positions has L + 1 ids
    _, _, num, _, _ = split_entries(over, offsets, _AllAnswer(), CAPACITY, overlap)
    lengths = np.concatenate([raw[raw <= CAPACITY], thd_lengths(num)])
    plan = plan_packing(lengths, CAPACITY, "bfd", 0)
    return plan.num_bins, plan.efficiency


def plan_wrapped(lengths: np.ndarray):
    doc, start, num, piece, offsets = wrapped_entries(lengths + 1, CAPACITY, 1, 0)
    return len(offsets) - 1, float(lengths.sum()) / ((len(offsets) - 1) * CAPACITY)


def strategies(repeats: int) -> None:
    """Buckets, split and wrapped beside plain BFD on the same lengths, interleaved."""
    print(f"\nstrategies beside plain BFD (capacity {CAPACITY}, best of {repeats}, interleaved in one loop)")
    print(f"{'samples':>10} {'strategy':>16} {'seconds':>9} {'packs':>10} {'efficiency':>10} {'time / bfd':>10}")
    for n in (1_000_000, 10_000_000):
        rng = np.random.default_rng(1)
        raw = np.maximum(1, rng.lognormal(np.log(400) - 0.5, 1.0, n)).astype(np.int64)  # some above CAPACITY
        clipped = np.minimum(raw, CAPACITY)
        cases = {"bfd": lambda: (lambda p: (p.num_bins, p.efficiency))(plan_packing(clipped, CAPACITY, "bfd", 0)),
                 "buckets (auto)": lambda: plan_buckets_auto(clipped),
                 f"split ({int((raw > CAPACITY).sum()):,} cut)": lambda: plan_split(raw),
                 "wrapped": lambda: plan_wrapped(raw)}
        best = {name: (float("inf"), None) for name in cases}
        for _ in range(repeats):
            for name, fn in cases.items():
                start = time.perf_counter()
                out = fn()
                seconds = time.perf_counter() - start
                if seconds < best[name][0]:
                    best[name] = (seconds, out)
        base = best["bfd"][0]
        for name, (seconds, (packs, eff)) in best.items():
            print(f"{n:>10,} {name:>16} {seconds:>9.3f} {packs:>10,} {eff:>10.4%} {seconds / base:>9.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--no-strategies", action="store_true")
    args = parser.parse_args()
    if not args.no_strategies:
        strategies(args.repeats)
    rows = []
    for n, algorithms in ((1_000_000, ("bfd", "ffd", "sequential", "first_fit_shuffle")), (10_000_000, ("bfd", "ffd"))):
        lengths = lognormal_lengths(n)
        for algorithm in algorithms:
            repeats = 1 if algorithm == "first_fit_shuffle" else args.repeats
            seconds, plan = best_time(lambda: plan_packing(lengths, CAPACITY, algorithm, seed=0), repeats)
            rows.append((n, algorithm, seconds, plan.num_bins, plan.lower_bound, plan.efficiency))
    print(f"lengths: log-normal, mean {lognormal_lengths(1_000_000).mean():.0f}, capacity {CAPACITY}; "
          f"best of {args.repeats}")
    print(f"{'samples':>10} {'algorithm':>18} {'seconds':>9} {'packs':>9} {'lower bd':>9} {'efficiency':>10}")
    for n, algorithm, seconds, packs, lower, eff in rows:
        print(f"{n:>10,} {algorithm:>18} {seconds:>9.3f} {packs:>9,} {lower:>9,} {eff:>10.4%}")
    ours_1m = next(r for r in rows if r[0] == 1_000_000 and r[1] == "bfd")
    ours_10m = next(r for r in rows if r[0] == 10_000_000 and r[1] == "bfd")
    print(f"bfd 10M: {ours_10m[2]:.3f} s (target < 0.5 s), {ours_10m[3] / ours_10m[4]:.5f} x lower bound")
    if args.no_trl:
        return
    try:
        import trl  # noqa: F401
    except ImportError:
        print("trl not installed (pip install 'megatron_pack[bench]'): TRL comparison skipped")
        return
    trl_seconds, trl_packs = trl_bfd(lognormal_lengths(1_000_000))
    print(f"TRL {trl.__version__} pack_dataset(strategy='bfd') 1M: {trl_seconds:.3f} s, {trl_packs:,} packs")
    print(f"ratio TRL / ours at 1M: {trl_seconds / ours_1m[2]:.1f}x faster (target >= 50x); "
          f"packs ours {ours_1m[3]:,} vs TRL {trl_packs:,} ({'<=' if ours_1m[3] <= trl_packs else '>'} TRL)")


if __name__ == "__main__":
    main()
