"""Microseconds per pack for collate + CP slice, against a per-sample Python-loop baseline.

For each pack size T in (4096, 32768, 131072) and CP in (1, 2, 8), a pack is filled with samples
of a long-tailed length mix (log-normal, median ~300 ids), then timed:

- ours: ``collate_thd`` (vectorised numpy) + ``slice_thd_batch`` (one index_select per key);
- baseline, measured in the same run: the common loop style, a Python loop over samples that
  builds lists (``tokens += ids[:-1]`` ...) then a loop over sub-sequences that cuts and
  concatenates the 2*CP chunks per sub-sequence with ``torch.cat``.

Both produce the same local tokens (checked). Prints one row per case with the ratio
baseline / ours. Run: ``.venv/bin/python bench/collate.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from megatron_pack.data.batches.thd import collate_thd
from megatron_pack.config.layout import pad_multiple
from megatron_pack.parallel.cp import slice_thd_batch

PACK_SIZES = (4096, 32768, 131072)
CP_SIZES = (1, 2, 8)


def make_pack(pack_size: int, multiple: int, rng: np.random.Generator) -> list[dict]:
    """Samples whose padded THD lengths fill ``pack_size`` exactly (the last one takes the rest)."""
    samples, used = [], 0
    while used < pack_size:
        num_ids = int(max(2, rng.lognormal(np.log(300), 0.9)))
        padded = -(-(num_ids - 1) // multiple) * multiple
        if used + padded > pack_size:
            num_ids, padded = pack_size - used + 1, pack_size - used
        ids = rng.integers(3, 32000, num_ids).astype(np.int64)
        mask = (np.arange(num_ids) >= num_ids // 3).astype(np.int8)
        samples.append({"input_ids": ids, "loss_mask": mask, "sample_id": len(samples)})
        used += padded
    return samples


def baseline(samples: list[dict], multiple: int, cp_size: int, cp_rank: int, pad_id: int = 0) -> dict:
    """Per-sample list building + per-sub-sequence chunk concatenation (the loop style)."""
    tokens, labels, loss_mask, position_ids, cu = [], [], [], [], [0]
    for sample in samples:
        ids, mask = list(sample["input_ids"]), list(sample["loss_mask"])
        n = len(ids) - 1
        pad = -(-n // multiple) * multiple - n
        tokens += ids[:-1] + [pad_id] * pad
        labels += ids[1:] + [pad_id] * pad
        loss_mask += [float(m) for m in mask[1:]] + [0.0] * pad
        position_ids += list(range(n + pad))
        cu.append(cu[-1] + n + pad)
    batch = {k: torch.tensor([v]) for k, v in
             (("tokens", tokens), ("labels", labels), ("loss_mask", loss_mask), ("position_ids", position_ids))}
    if cp_size == 1:
        return batch
    out = {}
    for key, value in batch.items():
        pieces = []
        for start, end in zip(cu[:-1], cu[1:]):
            chunks = value[:, start:end].chunk(2 * cp_size, dim=1)
            pieces += [chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]]
        out[key] = torch.cat(pieces, dim=1)
    return out


def ours(samples: list[dict], pack_size: int, multiple: int, cp_size: int, cp_rank: int) -> dict:
    batch = collate_thd(samples, pack_size=pack_size, pad_multiple=multiple, pad_to_max_length=True)
    return slice_thd_batch(batch, cp_size, cp_rank)


def time_us(fn, repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=0, help="calls per timing (0: scale with T)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"{'T':>7} {'CP':>3} {'samples':>8} {'ours us/pack':>13} {'baseline us/pack':>17} {'baseline/ours':>14}")
    for pack_size in PACK_SIZES:
        for cp_size in CP_SIZES:
            multiple = pad_multiple(cp_size, 1, False)
            samples = make_pack(pack_size, multiple, rng)
            rank = cp_size - 1
            got, want = ours(samples, pack_size, multiple, cp_size, rank), baseline(samples, multiple, cp_size, rank)
            for key in want:
                assert torch.equal(got[key].to(want[key].dtype), want[key]), (pack_size, cp_size, key)
            repeats = args.repeats or max(3, 400_000 // pack_size)
            t_ours = time_us(lambda: ours(samples, pack_size, multiple, cp_size, rank), repeats)
            t_base = time_us(lambda: baseline(samples, multiple, cp_size, rank), max(2, repeats // 4))
            print(f"{pack_size:>7} {cp_size:>3} {len(samples):>8} {t_ours:>13.0f} {t_base:>17.0f} {t_base / t_ours:>13.1f}x")


if __name__ == "__main__":
    main()
