"""One optimizer: CPU step time, checkpoint save / load time and size, megatron-core's optimizer against a baseline.

The baseline is another commit of this repository (``--baseline``, default the commit before megatron-core's
optimizer replaced ours on CPU: ``TrainOptimizer`` / ``ShardedTrainOptimizer``), checked out into a temporary
git worktree; both trees run the same worker (this file, ``--worker``) on 2 gloo ranks (DP=2, CPU, float32, one
torch thread a rank) in the same run, alternating, ``--repeats`` rounds each: a GPT of ``--layers`` layers and
hidden ``--hidden`` on random THD packs of ``--pack`` tokens, 2 packs a step, plain and with
``ddp.use_distributed_optimizer``. Reported per tree and optimizer: the median optimizer step time (the
``optimizer.step`` call alone) and the median whole step time over ``--steps`` steps after one warm-up step, the
checkpoint save and load (``Trainer.save`` / ``Trainer.load`` into a new trainer) seconds and the checkpoint's
bytes; then each as a ratio of this tree to the baseline.

Run: ``.venv/bin/python bench/optimizer.py [--baseline REV] [--layers 4] [--hidden 512] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASELINE = "2bcd0dd"
"""The last commit whose CPU path stepped our own AdamW (TrainOptimizer / ShardedTrainOptimizer)."""


def _timed(trainer, box: list) -> None:
    """Record the seconds of each ``trainer.optimizer.step`` call in ``box``."""
    step = trainer.optimizer.step

    def timed(lr):
        start = time.perf_counter()
        norm = step(lr)
        box.append(time.perf_counter() - start)
        return norm

    trainer.optimizer.step = timed


def worker(args) -> None:
    """One tree's measurement on this torchrun rank; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    from recompute import _pack  # bench/'s random THD packs (this file's folder is on the path)

    from megatron_pack.config import load_config
    from megatron_pack.data.batches.protocol import BatchList
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_trainer

    torch.set_num_threads(1)
    enable_cpu_compat_without_cuda()
    cfg = load_config([f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
                       f"model.ffn_hidden_size={args.hidden * 11 // 4}", "model.num_attention_heads=8",
                       f"packing.packed_sequence_size={args.pack}", f"model.seq_length={args.pack}",
                       "packing.pad_seq_to_mult=8", "train.global_batch_size=4", "parallel.context_parallel_size=1",
                       f"ddp.use_distributed_optimizer={args.distributed}", f"train.output_dir={args.out}"],
                      world_size=2)
    state = initialize_parallel(cfg)
    packs = [_pack(args.pack, seed) for seed in range(2 * (args.steps + 1))]
    trainer = build_trainer(cfg, state, BatchList(packs))
    optimizer_s: list[float] = []
    _timed(trainer, optimizer_s)
    step_s = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        trainer.train_step()
        step_s.append(time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter()
    path = trainer.save(f"{args.out}/checkpoints")
    save_s = time.perf_counter() - start
    destroy_parallel()
    state = initialize_parallel(cfg)
    fresh = build_trainer(cfg, state, BatchList(packs))
    dist.barrier()
    start = time.perf_counter()
    fresh.load(path)
    load_s = time.perf_counter() - start
    size = sum(f.stat().st_size for f in Path(path).iterdir())
    if state.rank == 0:
        print("RESULT " + json.dumps({"optimizer_s": statistics.median(optimizer_s[1:]),
                                      "step_s": statistics.median(step_s[1:]), "save_s": save_s, "load_s": load_s,
                                      "bytes": size}), flush=True)
    destroy_parallel()


def _run(tree: Path, args, distributed: bool, work: Path) -> dict:
    out = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--worker", "--layers", str(args.layers), "--hidden", str(args.hidden),
           "--pack", str(args.pack), "--steps", str(args.steps), "--distributed", str(distributed).lower(),
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench/optimizer.py: the worker failed in {tree}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--pack", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--distributed", default="false")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = work / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.baseline], check=True,
                       capture_output=True)
        try:
            trees = {"baseline": base, "this": REPO}
            results = {(t, d): [] for t in trees for d in (False, True)}
            for _ in range(args.repeats):
                for distributed in (False, True):
                    for name, tree in trees.items():
                        results[(name, distributed)].append(_run(tree, args, distributed, work))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)
    load = os.getloadavg()[0]
    print(f"{args.layers} layers, hidden {args.hidden}, packs of {args.pack}, DP=2 on CPU, "
          f"median of {args.repeats} rounds; load average {load:.2f}")
    print(f"{'optimizer':<12} {'tree':<9} {'opt step s':>10} {'step s':>8} {'save s':>7} {'load s':>7} {'MB':>7}")
    keys = ("optimizer_s", "step_s", "save_s", "load_s", "bytes")
    medians = {k: {m: statistics.median(r[m] for r in runs) for m in keys} for k, runs in results.items()}
    for distributed in (False, True):
        kind = "distributed" if distributed else "plain"
        for name in ("baseline", "this"):
            m = medians[(name, distributed)]
            print(f"{kind:<12} {name:<9} {m['optimizer_s']:>10.4f} {m['step_s']:>8.3f} {m['save_s']:>7.3f} "
                  f"{m['load_s']:>7.3f} {m['bytes'] / 1e6:>7.2f}")
        this, base = medians[("this", distributed)], medians[("baseline", distributed)]
        print(f"{kind:<12} {'ratio':<9} " + " ".join(f"{this[k] / base[k]:>{w}.3f}" for k, w in
                                                      zip(keys, (10, 8, 7, 7, 7))))


if __name__ == "__main__":
    main()
