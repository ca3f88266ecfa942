"""Benchmark: can CP load balance with padding reach max/mean <= 1.02 while keeping TE's THD layout?

Per-rank causal attention work over real (unpadded) query tokens, max over mean of the CP ranks,
mean over 400 packs of 4096 tokens (BFD over lognormal lengths) at CP 2 / 4 / 8, for:

- ``te``: Transformer Engine's layout: each sub-sequence padded at its end to ``2*CP``, cut into
  ``2*CP`` chunks, rank ``r`` keeps chunks ``r`` and ``2*CP-1-r`` (``thd_partition_indices``);
- ``reorder-longest`` / ``reorder-random``: the same pack with its sub-sequences reordered;
- ``pad-front`` (not TE's layout: TE reads the real tokens at the start of each padded segment):
  each sub-sequence's padding moved to its start, for reference;
- ``pad-spread`` (not TE's layout either): padding rotated over the ranks, sub-sequence ``i``'s
  padding starting at the first chunk of rank ``i mod CP``.

Two length mixes: median 70 tokens (the synthetic set) and median 400 (longer SFT samples).

    .venv/bin/python bench/cp_padding.py
"""

from __future__ import annotations

import numpy as np

from megatron_pack.config.layout import round_up
from megatron_pack.data.packing.algorithms import plan_packing

PACK = 4096


def rank_work(real: np.ndarray, cp: int, placement: str) -> np.ndarray:
    """Causal work per CP rank (a real query at position p costs p + 1) of sub-sequences of ``real`` lengths."""
    work = np.zeros(cp)
    owner = np.concatenate([np.arange(cp), np.arange(cp)[::-1]])  # chunk c -> rank (zigzag)
    for i, n in enumerate(real.tolist()):
        padded = int(round_up(n, 2 * cp))
        chunk = padded // (2 * cp)
        pad = padded - n
        slots = np.arange(padded)
        if placement == "front":
            real_slots = slots[pad:]
        elif placement == "spread":  # the padding starts at the first chunk of rank (i mod cp)
            start = min((i % cp) * chunk, padded - pad)
            real_slots = np.concatenate([slots[:start], slots[start + pad:]])
        else:
            real_slots = slots[:n]
        cost = np.arange(1, n + 1, dtype=np.float64)  # the k-th real token of the sequence attends to k tokens
        np.add.at(work, owner[real_slots // chunk], cost)
    return work


def packs(median: float, num_packs: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, int(num_packs * PACK / median / 1.6)), 2, PACK // 2)
    lengths = lengths.astype(np.int64)
    plan = plan_packing(round_up(lengths, 16), PACK, "bfd")
    return [lengths[b] for b in plan.bins()[:num_packs]]


def main() -> None:
    rng = np.random.default_rng(1)
    for median in (70, 400):
        batch = packs(median, 400)
        print(f"median sample length {median}: {len(batch)} packs, {np.mean([len(p) for p in batch]):.1f} sub-sequences "
              "per pack; max/mean per-rank real work (mean over packs; worst)")
        for cp in (2, 4, 8):
            cells = []
            for name, order, placement in (("te", None, "end"), ("reorder-longest", "longest", "end"),
                                           ("reorder-random", "random", "end"), ("pad-front", None, "front"),
                                           ("pad-spread", None, "spread")):
                ratios = []
                for p in batch:
                    q = np.sort(p)[::-1] if order == "longest" else rng.permutation(p) if order == "random" else p
                    w = rank_work(q, cp, placement)
                    ratios.append(w.max() / w.mean())
                cells.append(f"{name} {np.mean(ratios):.4f} ({np.max(ratios):.3f})")
            print(f"  CP={cp}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
