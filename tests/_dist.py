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

The ranks come from a pool: one set of gloo worker processes per pytest process, started on
the first ``spawn_world`` with torch and megatron-core already imported: each is a fork of the pool's fork server
(multiprocessing's ``forkserver``), which imported them once (about 5 CPU-s; a rank of its own would pay that
again, and a new pool after a failed case for each of its ranks). A world of ``n`` ranks runs on the
pool's first ``n`` processes (the pool grows to the largest world asked for); each case still
gets fresh state: a new ``FileStore`` and ``init_process_group``, the group destroyed after,
megatron-core's parallel state, microbatch calculator and RNG tracker destroyed, the default
torch seed, dtype, start method, working folder and environment restored. A case that hangs,
raises or crashes fails with the same message as before and takes the pool down with it (its
ranks may sit in a collective): the next case starts a new pool. ``fresh=True`` runs a world on
new processes instead, for a case that needs one (a peak-memory measurement, say).

``tests/conftest.py`` (and ``tests/functional/conftest.py``) make this importable as ``_dist``.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback
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


_RAISED_AT = [float("inf")]
"""When this rank's case raised (wall clock, comparable across the ranks of one machine)."""


def _entry(rank: int, worker: Callable[..., dict], world_size: int, store_dir: str, args: tuple,
           timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    dist.barrier()  # every rank started: the deadline counts from here
    stacks = open(os.path.join(store_dir, f"stacks{rank}.txt"), "w")  # noqa: SIM115 (closed below)
    faulthandler.dump_traceback_later(timeout_s - _stack_margin(timeout_s), exit=False, file=stacks)
    Path(store_dir, f"ready{rank}").touch()
    try:
        result = worker(rank, world_size, *args) or {}
        arrays = {key: np.asarray(value.detach().cpu() if torch.is_tensor(value) else value)
                  for key, value in result.items()}
        np.savez(os.path.join(store_dir, f"rank{rank}.npz"), **arrays)
        dist.barrier()
    except BaseException:
        _RAISED_AT[0] = min(_RAISED_AT[0], time.time())  # a rank that lost its failed peer raises later
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        stacks.close()
        dist.destroy_process_group()


def _stack_written(store_dir: Path, rank: int) -> bool:
    path = store_dir / f"stacks{rank}.txt"
    return path.is_file() and path.stat().st_size > 0


def _kill_world(processes: list, worker_name: str, store_dir: Path, what: str) -> None:
    """Kill every rank still alive and raise ``WorldTimeout`` with their stacks at the deadline."""
    alive = [rank for rank, proc in enumerate(processes) if proc.is_alive()]
    wait_until = time.monotonic() + 10.0  # a loaded machine may write the stacks a little late
    while time.monotonic() < wait_until and not all(_stack_written(store_dir, rank) for rank in alive):
        time.sleep(0.2)
    _kill(processes)
    stacks = []
    for rank in alive:
        path = store_dir / f"stacks{rank}.txt"
        text = path.read_text(errors="replace").strip() if path.is_file() else ""
        stacks.append(f"--- rank {rank} at the deadline ---\n{text or '(no stack written)'}")
    raise WorldTimeout(f"the world of {len(processes)} ranks running {worker_name} {what} (ranks {alive} "
                       "still running: a rank waits in a collective its peers never enter, or the machine is too "
                       "slow); killed.\n" + "\n".join(stacks))


def _kill(processes: list) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(10)


def _deadline_message(timeout_s: float, started: bool) -> str:
    return (f"did not finish within {timeout_s:.0f} s" if started else
            f"did not start (join the process group) within {STARTUP_TIMEOUT_S:.0f} s")


def _read_results(store_dir: Path, world_size: int) -> list[dict[str, np.ndarray]]:
    results = []
    for rank in range(world_size):
        with np.load(store_dir / f"rank{rank}.npz", allow_pickle=False) as data:
            results.append({key: data[key] for key in data.files})
    return results


# ---- the pool: gloo ranks started once per pytest process, each running one case after another ----

_TORCH_DEFAULT_SEED = 67280421310721
"""torch's built-in seed of its default generator, put back after each case so no case sees the seed the one
before set (a new rank's seed is not fixed either: its imports reseed it; a case that needs one seeds it)."""


def _preimport() -> None:
    """What every case would import first: torch, then megatron-core with its fused kernels left eager on a
    CPU host (``cpu_compat.eager_jit_fuser_without_cuda``, as the train and verify entries do)."""
    from megatron_pack.model.cpu_compat import eager_jit_fuser_without_cuda

    eager_jit_fuser_without_cuda()
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron_pack.training.loop  # noqa: F401


def _reset_process_state(environ: dict, cwd: str, start_method: str | None) -> None:
    """Undo what a case left in its process, so the next case starts as in a new process."""
    if "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
        from megatron.core.rerun_state_machine import destroy_rerun_state_machine
        from megatron.core.tensor_parallel import random as mrandom

        parallel_state.destroy_model_parallel()
        destroy_num_microbatches_calculator()
        destroy_rerun_state_machine()
        if mrandom._CUDA_RNG_STATE_TRACKER is not None:
            mrandom._CUDA_RNG_STATE_TRACKER.reset()
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    multiprocessing.set_start_method(start_method, force=True)
    torch.manual_seed(_TORCH_DEFAULT_SEED)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    gc.collect()  # the case's process groups left in reference cycles (trainers, DDP): see MAX_POOL_THREADS
    gc.freeze()  # what is left lives on (modules, caches): later collections skip it (see _pool_main)


def _pool_main(conn) -> None:
    """One pooled rank: receive a case, run it as ``_entry`` does, answer ``("ok"|"error", text)``."""
    _preimport()
    gc.freeze()  # the imports' objects (about 400,000) out of every later collection: 0.2 CPU-s each otherwise,
    # and the cases collect often (destroy_parallel after every layout, _reset_process_state after every case)
    environ, cwd = dict(os.environ), os.getcwd()
    start_method = multiprocessing.get_start_method(allow_none=True)
    while True:
        message = conn.recv()
        if message is None:
            return
        sys_path, payload = message
        sys.path[:0] = [p for p in sys_path if p not in sys.path]  # the test's modules, to unpickle its worker
        _RAISED_AT[0] = float("inf")
        try:
            _entry(*pickle.loads(payload))
            answer = ("ok", "", 0.0)
        except BaseException:  # noqa: BLE001 (reported to the parent, which fails the test)
            answer = ("error", traceback.format_exc(), min(_RAISED_AT[0], time.time()))
        try:
            _reset_process_state(environ, cwd, start_method)
        except BaseException:  # noqa: BLE001
            answer = ("error", answer[1] + "\nwhile resetting the pooled rank:\n" + traceback.format_exc(),
                      min(answer[2] or time.time(), time.time()))
        conn.send(answer)


class _Pool:
    """The pooled ranks of this process; ``ranks(n)`` starts missing ones, ``close()`` kills them all."""

    def __init__(self) -> None:
        self.processes: list = []
        self.conns: list = []

    def ranks(self, world_size: int) -> tuple[list, list]:
        context = multiprocessing.get_context("forkserver")
        if len(self.processes) < world_size:
            _start_fork_server()
        while len(self.processes) < world_size:
            parent, child = context.Pipe()
            # not a daemon: a case may start processes of its own (data loader or tokenize workers)
            proc = context.Process(target=_pool_main, args=(child,), name=f"dist-pool-{len(self.processes)}")
            proc.start()
            child.close()
            self.processes.append(proc)
            self.conns.append(parent)
        return self.processes[:world_size], self.conns[:world_size]

    def close(self) -> None:
        _kill(self.processes)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []


SERVER_PYTHONPATH_WAS = "MEGATRON_PACK_TEST_POOL_PYTHONPATH_WAS"
"""The caller's ``PYTHONPATH`` while the fork server starts (``_start_fork_server``); ``_pool_server`` puts it back."""
UNSET = "(unset)"


def _start_fork_server() -> None:
    """multiprocessing's fork server for the pooled ranks, running (a no-op when it is): it imports ``_pool_server``
    (torch, megatron-core, the training loop) once, and every rank is a fork of it instead of an interpreter
    importing them again (about 5 CPU-s a rank: the pool's first world of 6 ranks, and every pool after a failed
    case; a new pool of 2 ran its first case in 0.9 s instead of 5.1). Python 3.11's server does not take its parent's ``sys.path``, so this folder goes on its
    ``PYTHONPATH`` while it starts; the server restores the caller's, so the ranks' environment is the caller's."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(["_pool_server"])
    was = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), *([was] if was else [])])
    os.environ[SERVER_PYTHONPATH_WAS] = UNSET if was is None else was
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(SERVER_PYTHONPATH_WAS)
        if was is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = was


_POOL = _Pool()
atexit.register(_POOL.close)  # runs before multiprocessing's own exit hook, which would wait for the ranks


def _spawn_pooled(worker: Callable[..., dict], world_size: int, store_dir: Path, args: tuple,
                  timeout_s: float) -> None:
    processes, conns = _POOL.ranks(world_size)
    for rank, conn in enumerate(conns):
        conn.send((list(sys.path), pickle.dumps((rank, worker, world_size, str(store_dir), args, timeout_s))))
    pending = dict(enumerate(conns))
    deadline, started = time.monotonic() + STARTUP_TIMEOUT_S, False
    while pending:
        ready = multiprocessing.connection.wait(list(pending.values()) + [p.sentinel for p in processes],
                                                timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        errors = {}
        for rank, conn in list(pending.items()):
            if conn in ready:
                status, text, raised_at = conn.recv()
                del pending[rank]
                if status != "ok":
                    errors[rank] = (raised_at, text)
        if errors:
            _fail_pooled(worker.__name__, world_size, errors, pending)
        dead = [rank for rank in pending if not processes[rank].is_alive()]
        if dead:
            codes = {rank: processes[rank].exitcode for rank in dead}
            _POOL.close()
            raise AssertionError(f"rank(s) {dead} of the world of {world_size} running {worker.__name__} exited "
                                 f"(exit codes {codes}) before finishing")
        if not started and all((store_dir / f"ready{r}").exists() for r in range(world_size)):
            deadline, started = time.monotonic() + timeout_s, True
        elif pending and time.monotonic() >= deadline:
            try:
                _kill_world(processes, worker.__name__, store_dir, _deadline_message(timeout_s, started))
            finally:
                _POOL.close()
    if max((num_threads(p.pid) for p in _POOL.processes), default=0) > MAX_POOL_THREADS:
        _POOL.close()  # the next case starts new ranks (see MAX_POOL_THREADS)


MAX_POOL_THREADS = 150
"""A pooled rank with more threads than this is replaced after its case. Every live gloo process group holds 3
threads that wake up while idle (100 groups: about 0.1 CPU-s a second per rank; 400: 0.43, measured); the groups
megatron-core's DDP, optimizer and schedules made outlive a case in reference cycles (a trainer, its buffers)
until ``gc.collect()``, which ``_reset_process_state`` runs (test_train_parallel's ranks: 118-193 threads after
its worlds without it, 7-31 with it). A case that keeps more alive than this costs a new rank (its imports, about
5 CPU-s) instead of a core's share for the rest of the session."""


def num_threads(pid: int) -> int:
    """Threads of process ``pid`` (0 without /proc or when it is gone): the idle gloo groups a process keeps."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:  # no /proc (not Linux), or the rank is gone
        return 0


def _fail_pooled(worker_name: str, world_size: int, errors: dict, pending: dict) -> None:
    """Fail the case with every rank's error: the peers of a rank that raised fail soon after it (their
    collective lost a member), so their answers are awaited briefly and the rank that raised first is named."""
    wait_until = time.monotonic() + 5.0
    while pending and time.monotonic() < wait_until:
        for conn in multiprocessing.connection.wait(list(pending.values()), timeout=0.2):
            rank = next(r for r, c in pending.items() if c is conn)
            status, text, raised_at = pending.pop(rank).recv()
            if status != "ok":
                errors[rank] = (raised_at, text)
    _POOL.close()  # a rank may still wait in a collective its failed peer never enters
    first = min(errors, key=lambda r: (errors[r][0], r))  # the rank that raised first, not a peer that lost it
    others = "".join(f"\n--- rank {r} ---\n{errors[r][1]}" for r in sorted(errors) if r != first)
    raise AssertionError(f"rank {first} of the world of {world_size} running {worker_name} failed:\n"
                         f"{errors[first][1]}" + (f"\nthen:{others}" if others else ""))


def _spawn_fresh(worker: Callable[..., dict], world_size: int, store_dir: Path, args: tuple,
                 timeout_s: float) -> None:
    context = mp.start_processes(_entry, args=(worker, world_size, str(store_dir), args, timeout_s),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline, started = time.monotonic() + STARTUP_TIMEOUT_S, False
    while not context.join(timeout=max(0.0, min(0.5, deadline - time.monotonic()))):
        if not started and all((store_dir / f"ready{r}").exists() for r in range(world_size)):
            deadline, started = time.monotonic() + timeout_s, True
        elif time.monotonic() >= deadline:
            _kill_world(context.processes, worker.__name__, store_dir, _deadline_message(timeout_s, started))


def spawn_world(worker: Callable[..., dict], world_size: int, tmp_path: Path | str, *args: Any,
                timeout_s: float = DEFAULT_TIMEOUT_S, fresh: bool = False) -> list[dict[str, np.ndarray]]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's dict.

    The ranks are the session's pooled processes (``fresh=True``: new processes, for a case that
    needs them). Raises ``WorldTimeout`` (an ``AssertionError``: the test fails) when the world is
    still running ``timeout_s`` seconds after every rank joined the process group, or has not joined
    within ``STARTUP_TIMEOUT_S``; every rank is killed first. A rank that raises or dies fails the
    test with its traceback or exit code.
    """
    store_dir = Path(tmp_path) / f"world{world_size}_{worker.__name__}"
    store_dir.mkdir(parents=True, exist_ok=False)
    run = _spawn_fresh if fresh else _spawn_pooled
    run(worker, world_size, store_dir, args, timeout_s)
    return _read_results(store_dir, world_size)


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
        # the sub-world's groups a case left in reference cycles end before the next group connects (one run saw a
        # sub-world's store outlive it and the next group's connection closed by a peer: "connectFullMesh failed")
        gc.collect()
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, f"{name}_back"), world_size),
                                rank=rank, world_size=world_size)


def ListLoader(packs: list[dict]):
    """A loader over fixed packs with the resumable state the trainer checkpoints (the next pack):
    the library's ``BatchList``, which plays the loader protocol (``data/batches/protocol.py``)."""
    from megatron_pack.data.batches.protocol import BatchList

    return BatchList(packs)


def full_param(tensor: torch.Tensor, param: torch.nn.Parameter, state) -> torch.Tensor:
    """A TP-sharded parameter (or its grad) gathered over ``state.tp_group`` into the full tensor, honouring
    megatron's partition dim and stride (written here, not taken from the library: the tests compare the
    library against it). Every TP rank must call it."""
    tensor = tensor.detach().contiguous()
    if state.tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(state.tp_size)]
    dist.all_gather(shards, tensor, group=state.tp_group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(state.tp_size)], dim=dim)
