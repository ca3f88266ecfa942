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

Every world has a deadline: ``timeout_s`` (default ``DEFAULT_TIMEOUT_S``) from the moment every
rank has joined the process group (starting the ranks, mostly importing torch, may take up to
``STARTUP_TIMEOUT_S`` more on a loaded machine). A world still running then (typically a rank
stuck in a collective its peers never enter) is killed and the test fails with ``WorldTimeout``
naming the worker, the ranks still alive and each live rank's Python stack just before the
deadline (``faulthandler`` dumps them into ``stacks<r>.txt``), instead of blocking CI.

``tests/functional/conftest.py`` (and ``tests/unit`` via ``sys.path``) make this importable
as ``_dist``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


DEFAULT_TIMEOUT_S = 300.0
"""Deadline of one world's work: the slowest world in the suite takes ~60 s on a quiet 2-core machine."""
STARTUP_TIMEOUT_S = 300.0
"""Deadline for every rank to start and join the process group."""


class WorldTimeout(AssertionError):
    """A spawned world did not finish before its deadline (a hang): the ranks were killed."""


def _stack_margin(timeout_s: float) -> float:
    """How long before the deadline the ranks dump their stacks."""
    return min(5.0, 0.1 * timeout_s)


def _entry(rank: int, worker: Callable[..., dict], world_size: int, store_dir: str, args: tuple,
           timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    dist.barrier()  # every rank started: the deadline counts from here
    stacks = open(os.path.join(store_dir, f"stacks{rank}.txt"), "w")  # noqa: SIM115 (open until exit)
    faulthandler.dump_traceback_later(timeout_s - _stack_margin(timeout_s), exit=False, file=stacks)
    Path(store_dir, f"ready{rank}").touch()
    try:
        result = worker(rank, world_size, *args) or {}
        arrays = {key: np.asarray(value.detach().cpu() if torch.is_tensor(value) else value)
                  for key, value in result.items()}
        np.savez(os.path.join(store_dir, f"rank{rank}.npz"), **arrays)
        dist.barrier()
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()


def _stack_written(store_dir: Path, rank: int) -> bool:
    path = store_dir / f"stacks{rank}.txt"
    return path.is_file() and path.stat().st_size > 0


def _kill_world(context: mp.ProcessContext, worker_name: str, store_dir: Path, what: str) -> None:
    """Kill every rank still alive and raise ``WorldTimeout`` with their stacks at the deadline."""
    alive = [rank for rank, proc in enumerate(context.processes) if proc.is_alive()]
    wait_until = time.monotonic() + 10.0  # a loaded machine may write the stacks a little late
    while time.monotonic() < wait_until and not all(_stack_written(store_dir, rank) for rank in alive):
        time.sleep(0.2)
    for proc in context.processes:
        if proc.is_alive():
            proc.kill()
    for proc in context.processes:
        proc.join(10)
    stacks = []
    for rank in alive:
        path = store_dir / f"stacks{rank}.txt"
        text = path.read_text(errors="replace").strip() if path.is_file() else ""
        stacks.append(f"--- rank {rank} at the deadline ---\n{text or '(no stack written)'}")
    raise WorldTimeout(f"the world of {len(context.processes)} ranks running {worker_name} {what} (ranks {alive} "
                       "still running: a rank waits in a collective its peers never enter, or the machine is too "
                       "slow); killed.\n" + "\n".join(stacks))


def spawn_world(worker: Callable[..., dict], world_size: int, tmp_path: Path | str, *args: Any,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict[str, np.ndarray]]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's dict.

    Raises ``WorldTimeout`` (an ``AssertionError``: the test fails) when the world is still running
    ``timeout_s`` seconds after every rank joined the process group, or has not joined within
    ``STARTUP_TIMEOUT_S``; every rank is killed first.
    """
    store_dir = Path(tmp_path) / f"world{world_size}_{worker.__name__}"
    store_dir.mkdir(parents=True, exist_ok=False)
    context = mp.start_processes(_entry, args=(worker, world_size, str(store_dir), args, timeout_s),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline, started = time.monotonic() + STARTUP_TIMEOUT_S, False
    while not context.join(timeout=max(0.0, min(0.5, deadline - time.monotonic()))):
        if not started and all((store_dir / f"ready{r}").exists() for r in range(world_size)):
            deadline, started = time.monotonic() + timeout_s, True
        elif time.monotonic() >= deadline:
            what = (f"did not finish within {timeout_s:.0f} s" if started else
                    f"did not start (join the process group) within {STARTUP_TIMEOUT_S:.0f} s")
            _kill_world(context, worker.__name__, store_dir, what)
    results = []
    for rank in range(world_size):
        with np.load(store_dir / f"rank{rank}.npz", allow_pickle=False) as data:
            results.append({key: data[key] for key in data.files})
    return results


@contextlib.contextmanager
def sub_world(rank: int, size: int, store_dir: Path | str, name: str) -> Iterator[bool]:
    """Inside the block the default process group is the world's first ``size`` ranks (``True`` is
    yielded there; the other ranks get ``False`` and wait); after it, the whole world again. So one
    spawned world (one start-up, mostly importing torch) runs layouts of several world sizes::

        with sub_world(rank, 4, root, "four") as member:   # in a world of 6
            if member:
                ...                                        # a 4-rank layout on ranks 0..3
        ...                                                # the 6-rank layouts

    Call it on every rank, with megatron-core's groups destroyed; ``name`` is unique per use.
    """
    world_size = dist.get_world_size()
    dist.destroy_process_group()
    member = rank < size
    if member:
        os.environ["WORLD_SIZE"] = str(size)
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, f"{name}_sub"), size),
                                rank=rank, world_size=size)
    try:
        yield member
    finally:
        if member:
            dist.destroy_process_group()
            os.environ["WORLD_SIZE"] = str(world_size)
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, f"{name}_back"), world_size),
                                rank=rank, world_size=world_size)


def ListLoader(packs: list[dict]):
    """A loader over fixed packs with the resumable state the trainer checkpoints (the next pack):
    the library's ``BatchList``, which plays the loader protocol (``data/batches/protocol.py``)."""
    from megatron_pack.data.batches.protocol import BatchList

    return BatchList(packs)


def full_param(tensor: torch.Tensor, param: torch.nn.Parameter, state) -> torch.Tensor:
    """A TP-sharded parameter (or its grad) gathered over ``state.tp_group`` into the full tensor, honouring
    megatron's partition dim and stride (written here, not the library's ``merge_tp_shards``: the tests
    compare the library against it). Every TP rank must call it."""
    tensor = tensor.detach().contiguous()
    if state.tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(state.tp_size)]
    dist.all_gather(shards, tensor, group=state.tp_group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(state.tp_size)], dim=dim)
