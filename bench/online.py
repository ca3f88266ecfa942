"""Benchmark: online packing efficiency and throughput against the buffer size, vs offline BFD.

A stream of lognormal SFT-like lengths (median ~300 tokens, sigma 1.0, clipped to the pack) and
a bimodal one (80% ~150, 20% ~2500) is packed into 4096-token packs by ``OnlinePackStream``
with buffers of 64 .. 16384 samples, and by offline BFD (``plan_packing``) over the whole
stream, in the same run. Prints packs, efficiency (sample tokens / pack tokens), packs over
BFD's, and samples per second of the packer (best of ``--repeats``; lengths only, no tokens).

``--loader`` measures the whole online loader instead (``OnlineLoader`` as training reads it:
the synthetic set tokenized on the fly by the byte tokenizer, packed, collated) with
``data.num_workers`` 0 and 2, and prints samples and packs per second of each and their ratio.

    .venv/bin/python bench/online.py [--samples 200000] [--repeats 2]
    .venv/bin/python bench/online.py --loader [--loader-samples 20000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from megatron_pack.data.packing.algorithms import plan_packing, thd_lengths
from megatron_pack.data.packing.online import LengthStream, OnlinePacker, OnlinePackStream, block_seeded
from megatron_pack.data.store.metadata import PlanSettings

PACK = 4096
BUFFERS = (64, 256, 1024, 4096, 16384)
MIXES = {
    "lognormal": lambda rng, n: np.clip(rng.lognormal(np.log(300), 1.0, n), 2, PACK).astype(np.int64) + 1,
    "bimodal": lambda rng, n: np.clip(np.where(rng.random(n) < 0.8, rng.normal(150, 40, n),
                                               rng.normal(2500, 700, n)), 2, PACK).astype(np.int64) + 1,
}


def online(num_ids, num_samples: int, buffer_size: int) -> tuple[int, int, float]:
    settings = PlanSettings(pack_size=PACK, pad_multiple=1, algorithm="online", seed=0, on_overflow="drop",
                            max_length=PACK)
    stream = OnlinePackStream(LengthStream(num_samples, num_ids, settings), OnlinePacker(PACK, buffer_size=buffer_size),
                              chunk_size=min(1024, buffer_size))
    start = time.perf_counter()
    packs = 0
    while not stream.finished_epochs:
        stream.next_pack()
        packs += 1
    return packs, stream.finished_epochs[0]["num_pack_tokens"], time.perf_counter() - start


def loader_rate(num_samples: int, workers: int, pack_size: int = 4096) -> tuple[float, float]:
    """(samples/s, packs/s) of one epoch's worth of packs from the online loader, stream source."""
    from megatron_pack.config import Config, DataConfig, PackingConfig, TrainConfig
    from megatron_pack.data.batches.loader import build_loader
    from megatron_pack.data.batches.opening import open_dataset

    cfg = Config(data=DataConfig(source="synthetic", synthetic_num_samples=num_samples, num_workers=workers),
                 packing=PackingConfig(packed_sequence_size=pack_size, mode="online", online_source="stream",
                                       buffer_size=1024),
                 train=TrainConfig(global_batch_size=8))
    loader = build_loader(cfg, open_dataset(cfg), dp_rank=0, dp_size=1)
    start = time.perf_counter()
    packs = samples = 0
    while not loader.accounting:  # until every shard finished epoch 0
        info = loader.begin_step()
        for _ in range(info.num_microbatches):
            samples += len(next(loader)["sample_ids"])
            packs += 1
    elapsed = time.perf_counter() - start
    loader._reset()  # stops the DataLoader workers
    return samples / elapsed, packs / elapsed


def main_loader(num_samples: int) -> None:
    rates = {w: loader_rate(num_samples, w) for w in (0, 2)}
    for w, (samples, packs) in rates.items():
        print(f"loader, stream source, data.num_workers={w}: {samples:,.0f} samples/s, {packs:,.1f} packs/s "
              f"({samples / rates[0][0]:.2f}x workers=0)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--loader", action="store_true", help="measure the online loader with 0 and 2 workers")
    parser.add_argument("--loader-samples", type=int, default=20_000)
    args = parser.parse_args()
    if args.loader:
        main_loader(args.loader_samples)
        return
    for name, draw in MIXES.items():
        num_ids = block_seeded(draw, seed=0)
        lengths = thd_lengths(num_ids(0, 0, args.samples), 1)
        start = time.perf_counter()
        plan = plan_packing(lengths, PACK, "bfd")
        bfd_s = time.perf_counter() - start
        print(f"{name}: {args.samples} samples, mean length {lengths.mean():.0f}; offline BFD {plan.num_bins} packs, "
              f"efficiency {plan.efficiency:.4f}, {args.samples / bfd_s:,.0f} samples/s")
        for buffer_size in BUFFERS:
            runs = [online(num_ids, args.samples, buffer_size) for _ in range(args.repeats)]
            packs, tokens, _ = runs[0]
            best = min(r[2] for r in runs)
            print(f"  buffer {buffer_size:5d}: {packs} packs ({packs / plan.num_bins:.4f}x BFD), efficiency "
                  f"{tokens / (packs * PACK):.4f}, {args.samples / best:,.0f} samples/s")


if __name__ == "__main__":
    main()
