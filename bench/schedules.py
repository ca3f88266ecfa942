"""CPU step time of the training schedule: one ``Trainer.compute_gradients()`` (forward and backward of M packs
through the schedule, the step outcome and ``finalize_model_grads``) at PP=1, PP=2 (1F1B) and PP=2 x VP=2
(interleaved), for 4 and 8 micro-batches.

CPU, float32, gloo, one torch thread per process, a GPT of ``--layers`` layers (hidden ``--hidden``) on random
THD packs of ``--pack`` tokens (samples of 16-512 tokens), built by ``training.loop.build_trainer`` over a
``BatchList``: the code path of ``megatron-pack train``, whichever schedule that path runs. Each row is the best
of ``--repeats`` steps after one warm-up step (the slowest rank's at PP=2), in wall-clock seconds and in
the process's CPU seconds (``time.process_time``: what the step computed, less sensitive than the wall
clock to other work on a shared machine; at PP=2 a rank waiting in a receive may spend none). docs/benchmarks.md records this
script's numbers before and after the switch to megatron-core's schedules on every device.

Run: ``.venv/bin/python bench/schedules.py [--layers 4] [--hidden 256] [--pack 2048] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MICROBATCHES = (4, 8)


def _packs(pack_size: int, num: int) -> list[dict]:
    from megatron_pack.data.batches.thd import collate_thd

    rng = np.random.default_rng(0)
    packs = []
    for _ in range(num):
        samples, used = [], 0
        while True:
            n = int(rng.integers(16, min(513, pack_size // 2)))
            if used + -(-n // 8) * 8 > pack_size:
                break
            ids = rng.integers(1, 380, size=n + 1).tolist()
            samples.append({"input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n + 1 - n // 2)})
            used += -(-n // 8) * 8
        packs.append(collate_thd(samples, pack_size=pack_size, pad_multiple=8))
    return packs


def _config(args, pp: int, vp, num_microbatches: int):
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig

    return Config(model=ModelConfig(attention_backend="torch", num_layers=args.layers, hidden_size=args.hidden,
                                    ffn_hidden_size=args.hidden * 11 // 4, num_attention_heads=8,
                                    num_query_groups=4, kv_channels=args.hidden // 8, seq_length=args.pack),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp),
                  train=TrainConfig(global_batch_size=num_microbatches, train_iters=args.repeats + 1))


def _worker(rank: int, world: int, args, vp, store: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    from megatron_pack.data.batches.protocol import BatchList
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    rows = []
    for num in MICROBATCHES:
        cfg = _config(args, world, vp, num)
        state = initialize_parallel(cfg)
        trainer = build_trainer(cfg, state, BatchList(_packs(args.pack, num) * (args.repeats + 1)))
        best = best_cpu = float("inf")
        for _ in range(args.repeats + 1):  # the first step warms up
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            trainer.compute_gradients()
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - start_cpu)
        rows.append((best, best_cpu))
        destroy_parallel()
    np.save(f"{out}/rank{rank}.npy", np.array(rows))
    dist.destroy_process_group()


def _run(args, world: int, vp=None) -> np.ndarray:
    """[micro-batch counts, (wall s, CPU s)]: each the slowest rank's."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, args, vp, f"{tmp}/store", tmp), nprocs=world, join=True)
        return np.max([np.load(f"{tmp}/rank{r}.npy") for r in range(world)], axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--pack", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.layers % 4:
        parser.error(f"--layers ({args.layers}) must be a multiple of 4 (PP=2 x VP=2 chunks)")
    times = {"PP=1 (no pipelining)": _run(args, 1), "PP=2 (1F1B)": _run(args, 2),
             "PP=2 x VP=2 (interleaved)": _run(args, 2, vp=2)}
    print(f"{args.layers} layers, hidden {args.hidden}, {args.pack}-token packs, best of {args.repeats} steps")
    print("| schedule | " + " | ".join(f"M={m} wall s | M={m} CPU s" for m in MICROBATCHES) + " |")
    print("|---|" + "---|---|" * len(MICROBATCHES))
    for name, rows in times.items():
        print(f"| {name} | " + " | ".join(f"{wall:.3f} | {cpu:.3f}" for wall, cpu in rows) + " |")


if __name__ == "__main__":
    main()
