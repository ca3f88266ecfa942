"""Activation recomputation: peak activation memory and step time, with and without.

One process (CPU, float32, one torch thread), a small GPT (``--layers`` layers, hidden
``--hidden``) on random THD packs of ``--pack`` tokens (sub-sequences of 64-512 tokens padded
to 8), measured in the same run for ``model.recompute_granularity`` none / selective / full
(uniform, 1 layer per unit): the peak bytes of tensors alive for backward
(``megatron_pack.training.memory.SavedActivationMeter``; CPU has no allocator peak, on GPU read
``torch.cuda.max_memory_allocated``), the forward + backward time (best of ``--repeats``), and
both as ratios to no recomputation. Loss and gradients are checked equal by
tests/functional/test_recompute.py.

Run: ``.venv/bin/python bench/recompute.py [--layers 4] [--hidden 256] [--pack 4096] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch


def _pack(pack_size: int, seed: int = 0) -> dict:
    from megatron_pack.data.batches.thd import collate_thd

    rng = np.random.default_rng(seed)
    samples, used = [], 0
    while True:
        n = int(rng.integers(64, 513))
        if used + -(-n // 8) * 8 > pack_size:
            break
        ids = rng.integers(1, 380, size=n + 1).tolist()
        samples.append({"input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n + 1 - n // 2),
                        "sample_id": len(samples)})
        used += -(-n // 8) * 8
    return collate_thd(samples, pack_size=pack_size, pad_multiple=8)


def _measure(args, granularity: str, tmp: str) -> tuple[int, float]:
    from megatron_pack.config import load_config
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.data.batches.protocol import BatchList
    from megatron_pack.training.loop import build_trainer
    from megatron_pack.training.memory import SavedActivationMeter

    extra = [] if granularity == "none" else [f"model.recompute_granularity={granularity}"]
    cfg = load_config([f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
                       f"model.ffn_hidden_size={args.hidden * 11 // 4}", "model.num_attention_heads=8",
                       f"packing.packed_sequence_size={args.pack}", f"model.seq_length={args.pack}",
                       "packing.pad_seq_to_mult=8", "train.global_batch_size=1", f"train.output_dir={tmp}", *extra],
                      world_size=1)
    state = initialize_parallel(cfg)
    pack = _pack(args.pack)

    trainer = build_trainer(cfg, state, BatchList([pack] * args.repeats))
    best, peak = float("inf"), 0
    for _ in range(args.repeats):
        meter = SavedActivationMeter(exclude=trainer.model.parameters())
        start = time.perf_counter()
        with meter:
            trainer.compute_gradients()
        best = min(best, time.perf_counter() - start)
        peak = meter.peak_bytes
    destroy_parallel()
    return peak, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--pack", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {g: _measure(args, g, tmp) for g in ("none", "selective", "full")}
    base_peak, base_time = rows["none"]
    print(f"{'recompute':>10} {'peak saved bytes':>17} {'memory ratio':>13} {'step s':>8} {'time ratio':>11}")
    for name, (peak, seconds) in rows.items():
        print(f"{name:>10} {peak:>17,} {peak / base_peak:>12.2f}x {seconds:>8.3f} {seconds / base_time:>10.2f}x")


if __name__ == "__main__":
    main()
