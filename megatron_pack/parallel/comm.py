"""Every ``torch.distributed`` collective of the package, in one place.

A collective runs on the process group's backend, and each backend takes tensors on its own device:
NCCL only CUDA tensors, gloo (as this package uses it) CPU tensors. Call sites hold tensors where their
computation put them (a float64 count built on the CPU, an activation on the GPU); the functions here
move a tensor to the group's communication device for the collective and back to where it came from
after it, so a call site never asks which backend or device it runs on. A tensor already on the right
device is not copied.

Example (a CPU float64 count over the DP x CP group, which is an NCCL group on a GPU run)::

    vec = torch.tensor([loss_sum, num_tokens], dtype=torch.float64)   # on the CPU
    all_reduce(vec, group=state.dp_cp_group)                          # reduced in place, still on the CPU

Every function is a no-op on a group of one rank (and without ``torch.distributed``), so a caller
needs no ``if world_size > 1`` guard. tests/unit/test_collectives_module.py fails on a
``torch.distributed`` collective called anywhere else in the package.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def device_for_backend(backend: str) -> torch.device:
    """The device a backend's collectives take tensors on: ``nccl`` -> this process's GPU, else the CPU.

    >>> device_for_backend("gloo")
    device(type='cpu')
    """
    if str(backend).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_size(group: ProcessGroup) -> int:
    """Ranks in ``group`` (the world for None); 1 without ``torch.distributed``."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def comm_device(group: ProcessGroup) -> torch.device:
    """Where ``group``'s collectives take their tensors (see ``device_for_backend``)."""
    return device_for_backend(dist.get_backend(group))


def _on_wire(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``tensor`` on ``group``'s communication device, contiguous (itself when it is already there)."""
    wire = tensor.to(comm_device(group))
    return wire if wire.is_contiguous() else wire.contiguous()


def _back(tensor: torch.Tensor, wire: torch.Tensor) -> torch.Tensor:
    if wire is not tensor:
        tensor.copy_(wire)
    return tensor


def all_reduce(tensor: torch.Tensor, group: ProcessGroup = None, *, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place (``op``: 'sum', 'max' or 'min'); returns it."""
    if group_size(group) == 1:
        return tensor
    wire = _on_wire(tensor, group)
    dist.all_reduce(wire, op=_OPS[op], group=group)
    return _back(tensor, wire)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup = None) -> torch.Tensor:
    """``tensor`` of global rank ``src`` on every rank of ``group``, in place; returns it."""
    if group_size(group) == 1:
        return tensor
    wire = _on_wire(tensor, group)
    dist.broadcast(wire, src=src, group=group)
    return _back(tensor, wire)


def all_gather(tensor: torch.Tensor, group: ProcessGroup = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), by group rank, on ``tensor``'s device."""
    size = group_size(group)
    if size == 1:
        return [tensor]
    wire = _on_wire(tensor, group)
    out = [torch.empty_like(wire) for _ in range(size)]
    dist.all_gather(out, wire, group=group)
    return [t.to(tensor.device) for t in out]


def all_gather_into_tensor(local: torch.Tensor, group: ProcessGroup = None) -> torch.Tensor:
    """Every rank's ``local`` concatenated along dim 0, by group rank, on ``local``'s device."""
    size = group_size(group)
    if size == 1:
        return local.clone()
    wire = _on_wire(local, group)
    out = torch.empty((size * wire.size(0),) + tuple(wire.shape[1:]), dtype=wire.dtype, device=wire.device)
    dist.all_gather_into_tensor(out, wire, group=group)
    return out.to(local.device)


# torch 2.13 deprecates reduce_scatter_tensor in favour of reduce_scatter_single (same signature).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_tensor(full: torch.Tensor, group: ProcessGroup = None) -> torch.Tensor:
    """The sum over ``group`` of ``full``, this rank's 1/size of it along dim 0, on ``full``'s device."""
    size = group_size(group)
    if size == 1:
        return full.clone()
    wire = _on_wire(full, group)
    out = torch.empty((wire.size(0) // size,) + tuple(wire.shape[1:]), dtype=wire.dtype, device=wire.device)
    _reduce_scatter(out, wire, op=dist.ReduceOp.SUM, group=group)
    return out.to(full.device)


def all_to_all_single(chunks: torch.Tensor, group: ProcessGroup = None) -> torch.Tensor:
    """``chunks`` [size, ...]: chunk ``j`` goes to group rank ``j``; returns [size, ...] whose chunk ``j`` came
    from group rank ``j``, on ``chunks``' device. Its own inverse (the adjoint for autograd)."""
    size = group_size(group)
    if size == 1:
        return chunks.clone()
    if chunks.size(0) != size:
        raise ValueError(f"all_to_all_single takes one chunk per rank along dim 0: {chunks.size(0)} for {size} ranks.")
    wire = _on_wire(chunks, group)
    out = torch.empty_like(wire)
    dist.all_to_all_single(out, wire, group=group)
    return out.to(chunks.device)


def exchange(sends: Sequence[tuple[torch.Tensor, int]], receives: Sequence[tuple[torch.Tensor, int]],
             group: ProcessGroup = None) -> None:
    """Point-to-point: post every ``(tensor, global peer rank)`` send, then every receive into its tensor, in
    one batch, and wait for all of them. Messages between two ranks match in posting order, so both ends
    must post theirs in an agreed order. The tensors must already be on ``group``'s communication device
    (megatron-core's P2P shapes are made on its current device, which is that device)."""
    ops = [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer, group) for tensor, peer in receives]
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()


def barrier(group: ProcessGroup = None) -> None:
    """Wait for every rank of ``group``."""
    if group_size(group) > 1:
        dist.barrier(group=group)


def all_gather_object(obj: Any, group: ProcessGroup = None) -> list:
    """Every rank's picklable ``obj``, by group rank."""
    size = group_size(group)
    if size == 1:
        return [obj]
    out: list = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, dst: int, group: ProcessGroup = None) -> Optional[list]:
    """Every rank's picklable ``obj`` on global rank ``dst`` (by group rank); None on the other ranks."""
    size = group_size(group)
    if size == 1:
        return [obj]
    out: Optional[list] = [None] * size if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def broadcast_objects(objects: list, src: int, group: ProcessGroup = None) -> list:
    """Global rank ``src``'s picklable ``objects`` on every rank of ``group`` (in place; returned)."""
    if group_size(group) > 1:
        dist.broadcast_object_list(objects, src=src, group=group, device=comm_device(group))
    return objects


def group_ranks(group: ProcessGroup) -> Sequence[int]:
    """The global ranks of ``group``, by group rank."""
    if not dist.is_initialized():
        return [0]
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
