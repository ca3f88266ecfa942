"""Length buckets: pack short samples with short ones and long with long (``packing.buckets``).

Bucket ``i`` holds the samples whose THD length ``n - 1`` lies in ``(b[i-1], b[i]]`` (``b[-1] =
0``, the last bucket is open above), and each bucket is planned on its own with the configured
algorithm. ``auto`` puts the boundaries at the length quartiles. Packs are stored bucket after
bucket; ``bin_bucket`` names each pack's bucket, so the sampler can keep buckets apart
(``packing.bucket_order=sequential``) or shuffle them together (``interleave``).

Example: boundaries ``[4]``, lengths ``[4, 2, 3, 3, 6, 5]`` at capacity 6: bucket 0 holds
samples 0-3 (lengths <= 4), bucket 1 samples 4-5; BFD per bucket gives 2 packs of 6 tokens in
bucket 0 and 2 packs (6 and 5 tokens) in bucket 1.
"""

from __future__ import annotations

import numpy as np

from megatron_pack.data.packing.algorithms import PackingPlan, plan_packing

AUTO_QUANTILES = (0.25, 0.5, 0.75)


def bucket_boundaries(spec, thd_lengths: np.ndarray) -> list[int]:
    """Boundaries for ``packing.buckets``: ``None`` -> ``[]``, ``'auto'`` -> distinct length quartiles, a list as given."""
    if spec is None:
        return []
    if spec == "auto":
        if len(thd_lengths) == 0:
            return []
        quartiles = np.quantile(np.asarray(thd_lengths), AUTO_QUANTILES, method="lower")
        top = int(np.max(thd_lengths))
        return sorted({int(q) for q in quartiles if int(q) < top})
    return [int(b) for b in spec]


def assign_buckets(thd_lengths: np.ndarray, boundaries: list[int]) -> np.ndarray:
    """Bucket index of every length: the first ``i`` with ``length <= boundaries[i]``, else ``len(boundaries)``."""
    return np.searchsorted(np.asarray(boundaries, dtype=np.int64), np.asarray(thd_lengths), side="left").astype(np.int32)


def plan_buckets(lengths: np.ndarray, bucket_of: np.ndarray, num_buckets: int, capacity: int, algorithm: str,
                 seed: int) -> tuple[PackingPlan, np.ndarray]:
    """Plan each bucket separately; return the combined plan (bins bucket after bucket) and ``bin_bucket``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    orders, sizes, buckets = [], [], []
    for b in range(num_buckets):
        idx = np.flatnonzero(bucket_of == b)
        if idx.size == 0:
            continue
        sub = plan_packing(lengths[idx], capacity, algorithm, seed + b)
        orders.append(idx[sub.order])
        sizes.append(sub.bin_sizes())
        buckets.append(np.full(sub.num_bins, b, dtype=np.int32))
    if not orders:
        return plan_packing(lengths, capacity, algorithm, seed), np.zeros(0, np.int32)
    offsets = np.zeros(sum(len(s) for s in sizes) + 1, dtype=np.int64)
    np.cumsum(np.concatenate(sizes), out=offsets[1:])
    return PackingPlan(np.concatenate(orders), offsets, lengths, capacity), np.concatenate(buckets)


def bucket_statistics(plan: PackingPlan, thd: np.ndarray, bucket_of: np.ndarray, bin_bucket: np.ndarray,
                      boundaries: list[int], sample_of_entry: np.ndarray) -> list[dict]:
    """One dict per bucket: its length range, samples, packs, tokens and packing efficiency."""
    stats = []
    loads = plan.bin_loads()
    edges = [0] + list(boundaries) + [None]
    for b in range(len(boundaries) + 1):
        entries = bucket_of == b
        packs = bin_bucket == b
        num_packs = int(packs.sum())
        stats.append({
            "bucket": b, "min_length_exclusive": edges[b], "max_length": edges[b + 1],
            "num_samples": int(np.unique(sample_of_entry[entries]).size), "num_entries": int(entries.sum()),
            "num_packs": num_packs, "num_tokens": int(thd[entries].sum()),
            "packing_efficiency": round(100 * float(loads[packs].sum()) / (num_packs * plan.capacity), 2)
            if num_packs else 0.0})
    return stats
