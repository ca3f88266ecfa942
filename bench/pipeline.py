"""Pipeline stages: the 1F1B schedule's bubble and step time against one stage, for 4 and 8 micro-batches,
and the interleaved schedule's (virtual stages, VP=2) against 1F1B's.

CPU, float32, gloo, one torch thread per process, a GPT of ``--layers`` layers (hidden ``--hidden``)
on random THD packs of ``--pack`` tokens (samples of 16-512 tokens), measured in the same run:

* PP=1: one process holds every layer (``training.schedule.forward_backward_cpu``);
* PP=2: two processes, ``--layers / 2`` layers each (``training.pipeline_schedule.forward_backward_1f1b``
  over ``parallel.pipeline.StageLink``);
* PP=2 x VP=2: two processes, two chunks of ``--layers / 4`` layers each, rank r's chunk v holding
  layer block 2v + r (``training.interleaved_schedule.forward_backward_interleaved`` over
  ``parallel.pipeline.RingLink``).

For each micro-batch count M it prints the step time (forward + backward of M packs, best of
``--repeats``), its ratio to PP=1, and the bubble: the share of the step each stage spent blocked in a
send or receive (``seconds_waiting`` of the link; transfers included), next to the ideal
``(P - 1) / (V * M + P - 1)`` (1F1B: V = 1). On one machine the two stages share its cores, so the
step-time ratio says what the schedule costs here, not what two GPUs gain. The memory estimate is
compared with measured bytes by ``tests/functional/_memory_cases.py`` (docs/benchmarks.md), not here.

Run: ``.venv/bin/python bench/pipeline.py [--layers 4] [--hidden 256] [--pack 2048] [--repeats 3]``.
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


def _config(args, pp: int, vp=None):
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig

    return Config(model=ModelConfig(attention_backend="torch", num_layers=args.layers, hidden_size=args.hidden,
                                    ffn_hidden_size=args.hidden * 11 // 4, num_attention_heads=8,
                                    num_query_groups=4, kv_channels=args.hidden // 8, seq_length=args.pack),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp))


def _worker(rank: int, world: int, args, vp, store: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.chunks import build_model_chunks
    from megatron_pack.training.interleaved_schedule import chunk_iterators, forward_backward_interleaved
    from megatron_pack.training.pipeline_schedule import forward_backward_1f1b, stage_link
    from megatron_pack.training.schedule import forward_backward_cpu
    from megatron_pack.training.step import forward_step

    cfg = _config(args, world, vp)
    state = initialize_parallel(cfg)
    chunks = build_model_chunks(cfg, state)
    model = chunks[0]
    link = stage_link(cfg, state)
    rows = []
    for num in MICROBATCHES:
        packs = _packs(args.pack, num)
        best, waited = float("inf"), 0.0
        for _ in range(args.repeats + 1):  # the first round warms up
            for chunk in chunks:
                chunk.zero_grad_buffer()
            before = link.seconds_waiting if link else 0.0
            dist.barrier()
            start = time.perf_counter()
            if link is None:
                forward_backward_cpu(forward_step_func=forward_step, data_iterator=iter(packs), model=model,
                                     num_microbatches=num)
            elif vp:
                forward_backward_interleaved(forward_step_func=forward_step, model_chunks=chunks, link=link,
                                             data_iterators=chunk_iterators(iter(packs), vp), num_microbatches=num)
            else:
                forward_backward_1f1b(forward_step_func=forward_step, data_iterator=iter(packs), model=model,
                                      num_microbatches=num, link=link)
            seconds = time.perf_counter() - start
            if seconds < best:
                best, waited = seconds, (link.seconds_waiting - before) if link else 0.0
        rows.append((num, best, waited))
    np.save(f"{out}/rank{rank}.npy", np.array(rows))
    destroy_parallel(destroy_process_group=True)


def _run(args, world: int, vp=None) -> list[np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, args, vp, f"{tmp}/store", tmp), nprocs=world, join=True)
        return [np.load(f"{tmp}/rank{r}.npy") for r in range(world)]


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
    one, two, four = _run(args, 1)[0], _run(args, 2), _run(args, 2, vp=2)
    print(f"{args.layers} layers, hidden {args.hidden}, {args.pack}-token packs, best of {args.repeats}")
    print("| micro-batches | schedule | PP=1 step s | PP=2 step s | ratio | bubble stage 0 | bubble stage 1 | ideal |")
    print("|---|---|---|---|---|---|---|---|")
    for i, num in enumerate(MICROBATCHES):
        pp1 = one[i][1]
        for name, runs, vp in (("1F1B (VP=1)", two, 1), ("interleaved (VP=2)", four, 2)):
            pp2 = max(r[i][1] for r in runs)
            bubbles = [r[i][2] / r[i][1] for r in runs]
            print(f"| {num} | {name} | {pp1:.3f} | {pp2:.3f} | {pp2 / pp1:.2f} | {bubbles[0]:.0%} | {bubbles[1]:.0%} | "
                  f"{1 / (vp * num + 1):.0%} |")


if __name__ == "__main__":
    main()
