"""Benchmark: what the checkpoint manifest costs on a 1 GB checkpoint (one process, CPU).

The same state (``--gigabytes`` of float32 tensors, half "model", half "optimizer", as the
trainer's sharded checkpoints hold them) is saved ``--repeats`` times each way, interleaved:

- baseline: ``torch.distributed.checkpoint.save`` of the state plus the per-rank file, as
  ``save_checkpoint`` wrote before manifests;
- ``save_checkpoint``: the same state as the trainer writes it (each tensor a whole ``ShardedTensor``,
  in a world of one), plus hashing every file (sha256) and writing ``manifest.json``.

Then the checks a reader makes: sizes only (what ``train --check`` does before launch), sizes and
sha256 of every file (``export``, ``verify``, and a resume, spread over its ranks), against the
baseline of reading the checkpoint back with DCP (what a resume reads anyway). Printed: seconds
(median) and each as a ratio of its baseline; the hashing throughput in MB/s.

    .venv/bin/python bench/checkpoint_manifest.py [--gigabytes 1] [--repeats 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _state(gigabytes: float) -> dict:
    import torch

    per_tensor = 32 * 2**20  # 128 MB tensors of float32
    count = max(2, int(gigabytes * 2**30 / (4 * per_tensor)))
    gen = torch.Generator().manual_seed(0)
    state = {}
    for i in range(count):
        part = "model" if i < count // 2 else "optimizer.exp_avg"
        state[f"{part}.t{i}"] = torch.randn(per_tensor, generator=gen)
    return state


def _sharded(state: dict) -> dict:
    """Each tensor whole, as the trainer describes it in a world of one (``model.<name>`` stored as ``<name>``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k.removeprefix("model."), v, replica_id=0) for k, v in state.items()}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from megatron_pack.training import checkpoint as ckpt
    from megatron_pack.training.checkpoint_files import checkpoint_problems

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt_manifest_"))
    state = _state(args.gigabytes)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # what DCP's conversion needs
    sharded = _sharded(state)
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401  (imported before any timing)
    times: dict[str, list[float]] = {k: [] for k in ("dcp save", "save_checkpoint", "dcp load", "sizes", "sha256")}
    for r in range(args.repeats):
        plain = work / f"plain{r}"
        plain.mkdir(parents=True)

        def plain_save():
            dcp.save(state, checkpoint_id=str(plain), no_dist=True)
            torch.save({"step": 1}, plain / "rank_00000.pt")

        times["dcp save"].append(_timed(plain_save))
        root = work / f"manifest{r}"
        times["save_checkpoint"].append(_timed(lambda: ckpt.save_checkpoint(
            root, 1, sharded_state=sharded, rank_state={"step": 1}, meta={}, keep_last=1)))
        step = root / ckpt.step_dirname(1)
        empty = {k: torch.empty_like(v) for k, v in state.items()}
        times["dcp load"].append(_timed(lambda: dcp.load(empty, storage_reader=ckpt.checkpoint_reader(plain),
                                                         no_dist=True)))
        times["sizes"].append(_timed(lambda: checkpoint_problems(step, checksums=False)))
        times["sha256"].append(_timed(lambda: checkpoint_problems(step, checksums=True)))
        assert checkpoint_problems(step) == []
        shutil.rmtree(plain)
        shutil.rmtree(root)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"checkpoint: {nbytes / 1e9:.2f} GB in {len(state)} tensors, {args.repeats} rounds (median seconds)")
    print(f"  save without manifest (dcp.save + rank file)   {med['dcp save']:.2f} s")
    print(f"  save_checkpoint (with manifest)                 {med['save_checkpoint']:.2f} s   "
          f"x{med['save_checkpoint'] / med['dcp save']:.2f} of the save without")
    print(f"  read back with DCP (what a resume reads)        {med['dcp load']:.2f} s")
    print(f"  verify sizes (train --check, before launch)     {med['sizes'] * 1e3:.2f} ms  "
          f"x{med['sizes'] / med['dcp load']:.4f} of the read")
    print(f"  verify sha256 of every file (one process)       {med['sha256']:.2f} s   "
          f"x{med['sha256'] / med['dcp load']:.2f} of the read, {nbytes / med['sha256'] / 1e6:.0f} MB/s; a resume "
          "spreads it over its ranks")
    shutil.rmtree(work, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
