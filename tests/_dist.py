"""Spawn a world of gloo ranks on CPU from a pytest test, and collect what each rank returns.

Usage (the worker must be a module-level function so the spawned processes can import it)::

    from _dist import spawn_world

    def _worker(rank: int, world_size: int, scale: float) -> dict:
        t = torch.full((2,), float(rank))
        torch.distributed.all_reduce(t)
        return {"sum": t.numpy() * scale}

    def test_sum(tmp_path):
        results = spawn_world(_worker, 2, tmp_path, 1.0)     # one dict per rank
        assert results[1]["sum"].tolist() == [1.0, 1.0]

Each rank starts ``torch.distributed`` with the gloo backend through a ``FileStore`` in
``tmp_path`` (no ports, so concurrent tests never collide), runs ``worker(rank, world_size,
*args)``, and writes the returned dict of arrays/numbers to ``rank<r>.npz``; the parent reads
them back with ``allow_pickle=False``. torchrun-style env vars (RANK, WORLD_SIZE, LOCAL_RANK)
are set so code that reads them behaves as under torchrun. A failing rank fails the test with
its traceback. Each rank runs single-threaded (2-core CI) and deterministic.

``tests/functional/conftest.py`` (and ``tests/unit`` via ``sys.path``) make this importable
as ``_dist``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, worker: Callable[..., dict], world_size: int, store_dir: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = worker(rank, world_size, *args) or {}
        arrays = {key: np.asarray(value.detach().cpu() if torch.is_tensor(value) else value)
                  for key, value in result.items()}
        np.savez(os.path.join(store_dir, f"rank{rank}.npz"), **arrays)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_world(worker: Callable[..., dict], world_size: int, tmp_path: Path | str, *args: Any
                ) -> list[dict[str, np.ndarray]]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's dict."""
    store_dir = Path(tmp_path) / f"world{world_size}_{worker.__name__}"
    store_dir.mkdir(parents=True, exist_ok=False)
    mp.start_processes(_entry, args=(worker, world_size, str(store_dir), args), nprocs=world_size,
                       join=True, start_method="spawn")
    results = []
    for rank in range(world_size):
        with np.load(store_dir / f"rank{rank}.npz", allow_pickle=False) as data:
            results.append({key: data[key] for key in data.files})
    return results


class ListLoader:
    """A loader over fixed packs with the resumable state the trainer checkpoints (``next``)."""

    def __init__(self, packs: list[dict]):
        self.packs, self.next = packs, 0

    def __iter__(self):
        while self.next < len(self.packs):
            self.next += 1
            yield self.packs[self.next - 1]

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = int(state["next"])
