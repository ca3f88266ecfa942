"""Checkpoints of plain tensors in the trainer's format, written and read through the trainer's own path.

The trainer saves ``resharding.sharded_state`` of its model with ``checkpoint.save_checkpoint`` and reads
it back with ``model_reader.CheckpointModel.read_slices``. Tests of the checkpoint machinery (atomicity,
manifest, allowlist, damage, resume) do the same with a few plain tensors instead of a model: each
tensor whole, as a process holding all of it describes it (a ``ShardedTensor`` at offset 0), model
tensors under ``model.<name>`` and optimizer state under ``optimizer.<state>.<name>``, as the trainer's
keys are. DCP and megatron-core's conversion need a process group, so the save and the read run in a
world of one (a gloo group over an in-memory store, in this process: no new processes).

    with world_of_one():
        path = save(root, 3, {"w": w}, {"exp_avg.w": m}, rank_state={"step": 3}, meta={})
        model, optim = load(path, {"w": torch.zeros(2, 3)}, {"exp_avg.w": torch.zeros(2, 3)})
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """A gloo process group of this process alone (none may exist before); destroyed on exit."""
    assert not dist.is_initialized(), "a process group is already running"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(model: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]) -> dict:
    """The sharded state of whole tensors: ``model.<name>`` stored as ``<name>`` (as megatron-core keys a
    parameter), ``optim`` keys (``exp_avg.<name>``) as ``optimizer.exp_avg.<name>``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    state = {f"model.{n}": ShardedTensor.from_rank_offsets(n, t, replica_id=0) for n, t in model.items()}
    state.update({f"optimizer.{k}": ShardedTensor.from_rank_offsets(f"optimizer.{k}", t, replica_id=0)
                  for k, t in optim.items()})
    return state


def save(root: str | Path, step: int, model: dict[str, torch.Tensor], optim: dict[str, torch.Tensor], *,
         rank_state: dict, meta: dict, keep_last: int = 2) -> Path:
    """``checkpoint.save_checkpoint`` of these tensors (call it inside ``world_of_one``)."""
    from megatron_pack.training.checkpoint import save_checkpoint

    return save_checkpoint(root, step, sharded_state=sharded(model, optim), rank_state=rank_state, meta=meta,
                           keep_last=keep_last)


def load(path: str | Path, model: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]
         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What the trainer's reader gives for tensors shaped like ``model`` / ``optim`` (inside ``world_of_one``)."""
    from megatron_pack.training.model_reader import CheckpointModel

    loaded = CheckpointModel(path).read_slices(sharded(model, optim))
    return ({n: loaded[f"model.{n}"] for n in model}, {k: loaded[f"optimizer.{k}"] for k in optim})
