"""The one reader of a checkpoint's model weights: train, verify and export read them here.

A checkpoint is in one of two formats (``meta.json`` ``format``):

* layout-free (``SHARDED_FORMAT``, what the trainer writes): every parameter once, by global
  identity (``resharding.py``). The trainer reads the slices its own layout asks for
  (:meth:`CheckpointModel.read_slices`); verify and export read the whole TP=1 model in one process
  (:meth:`CheckpointModel.shards` gives it as one shard);
* the older per-TP-rank format: ``model/tp<r>/<name>`` tensors, one set per TP rank. Verify and
  export read every rank's shards (:meth:`CheckpointModel.shards`, in TP rank order); the trainer
  cannot reshard them and says so.

:meth:`CheckpointModel.load_into` puts either into a TP=1 model (verify), checking each parameter's
name and shape, and reading only the LoRA adapters of a ``peft=lora`` checkpoint (the base comes
from ``model.pretrained``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from megatron_pack.training.checkpoint_files import SHARDED_FORMAT, read_meta, verified_checkpoint


class CheckpointModel:
    """The model weights of checkpoint folder ``path`` (already chosen and verified); ``key`` is the
    setting that named it, for messages (``verify.checkpoint``, ``export.checkpoint``, ``checkpoint.load``)."""

    def __init__(self, path: str | Path, key: str = "checkpoint.load"):
        self.path, self.key = Path(path), key
        self.meta = read_meta(self.path)

    @classmethod
    def open(cls, checkpoint: str | Path, key: str) -> "CheckpointModel":
        """The checkpoint ``checkpoint`` names (a ``step_*`` folder or a ``checkpoint.save`` root, whose
        newest intact one is taken), every file checked against its manifest first."""
        return cls(verified_checkpoint(checkpoint, key), key)

    @property
    def layout_free(self) -> bool:
        """Written by global identity (any layout reads it back), not per TP rank."""
        return self.meta.get("format") == SHARDED_FORMAT

    @property
    def peft(self) -> Optional[dict]:
        """The ``peft`` block of meta.json (None: a full fine-tuning checkpoint)."""
        return self.meta.get("peft")

    def read_slices(self, sharded_state: dict) -> dict[str, torch.Tensor]:
        """The slices ``sharded_state`` (``resharding.sharded_state`` of this run's layout) asks for
        (collective over the ranks that read; train)."""
        from megatron_pack.training.checkpoint import checkpoint_reader
        from megatron_pack.training.resharding import load_sharded

        if not self.layout_free:
            raise ValueError(f"checkpoint {self.path} was written in the older per-tensor-parallel-rank format "
                             f"(meta.json format {self.meta.get('format')!r}, expected {SHARDED_FORMAT!r}); it "
                             "cannot be resharded: resume it with the megatron_pack version that wrote it, or start "
                             "a new run.")
        return load_sharded(sharded_state, checkpoint_reader(self.path))

    def shards(self) -> list[dict[str, torch.Tensor]]:
        """Every TP rank's model tensors in one process (TP rank order), keyed by parameter name: a
        layout-free checkpoint as one TP=1 shard (``checkpoint.read_full_model``). Export and verify."""
        from megatron_pack.training.checkpoint import read_full_model

        if self.layout_free:
            return [read_full_model(self.path)]
        return self._tp_shards()

    def _tp_shards(self) -> list[dict[str, torch.Tensor]]:
        import torch.distributed.checkpoint as dcp

        from megatron_pack.training.checkpoint import checkpoint_reader

        tp = int(self.meta.get("tensor_model_parallel_size", 1))
        stored = checkpoint_reader(self.path).read_metadata().state_dict_metadata  # via the allowlist, not pickle
        state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in stored.items()
                 if key.startswith("model/")}
        if not state:
            raise ValueError(f"{self.key} ({self.path}) holds no model tensors (model/tp<r>/...); it is not a "
                             "megatron_pack training checkpoint.")
        dcp.load(state, storage_reader=checkpoint_reader(self.path), no_dist=True)
        shards: list[dict] = [{} for _ in range(tp)]
        for key, tensor in state.items():
            _, rank, name = key.split("/", 2)
            shards[int(rank.removeprefix("tp"))][name] = tensor
        return shards

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy the weights into a TP=1 model: all of its parameters, or a peft=lora checkpoint's adapters."""
        shards = self.shards()
        with torch.no_grad():
            for name, param in self._params(model):
                missing = [r for r, shard in enumerate(shards) if name not in shard]
                if missing:
                    where = name if self.layout_free else f"model/tp{missing[0]}/{name}"
                    raise ValueError(f"checkpoint {self.path} has no {where}: it was written for another model; "
                                     "use the same model.* settings as the training run.")
                full = merge_tp_shards([shard[name] for shard in shards], param)
                if full.shape != param.shape:
                    raise ValueError(f"checkpoint {self.path}: {name} has shape {tuple(full.shape)}, the model "
                                     f"expects {tuple(param.shape)}; use the same model.* settings as the training run.")
                param.copy_(full)

    def _params(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters the checkpoint holds: all of them, or the LoRA adapters of a peft=lora run."""
        from megatron_pack.model.peft.lora import is_adapter_param

        named = list(model.named_parameters())
        peft = self.peft
        has_adapters = any(is_adapter_param(n) for n, _ in named)
        if peft and not has_adapters:
            raise ValueError(f"checkpoint {self.path} holds LoRA adapters (peft=lora, dim {peft['dim']}, targets "
                             f"{peft['target_modules']}); add peft=lora with the same peft.* and "
                             f"model.pretrained={peft['base_model']}.")
        if has_adapters and not peft:
            raise ValueError(f"checkpoint {self.path} is a full fine-tuning checkpoint; drop peft=lora to load it.")
        return [(n, p) for n, p in named if is_adapter_param(n)] if peft else named


def merge_tp_shards(shards: list[torch.Tensor], param: torch.nn.Parameter) -> torch.Tensor:
    """Full tensor from TP shards (rank order), honouring megatron's partition dim and stride."""
    if len(shards) == 1 or not getattr(param, "tensor_model_parallel", False):
        return shards[0]
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)
