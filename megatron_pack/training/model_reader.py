"""The one reader of a checkpoint's model weights: train, verify and export read them here.

A checkpoint stores every parameter once, by global identity (``meta.json`` ``format``
``SHARDED_FORMAT``, ``resharding.py``). The trainer reads the slices its own layout asks for
(:meth:`CheckpointModel.read_slices`); verify and export read the whole TP=1 model in one process
(:meth:`CheckpointModel.shards` gives it as one shard). A folder of another format is refused when
it is opened (``checkpoint_files.check_format``).

:meth:`CheckpointModel.load_into` puts the weights into a TP=1 model (verify), checking each parameter's
name and shape, and reading only the LoRA adapters of a ``peft=lora`` checkpoint (the base comes
from ``model.pretrained``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from megatron_pack.training.checkpoint_files import check_format, read_meta, verified_checkpoint


class CheckpointModel:
    """The model weights of checkpoint folder ``path`` (already chosen and verified); ``key`` is the
    setting that named it, for messages (``verify.checkpoint``, ``export.checkpoint``, ``checkpoint.load``)."""

    def __init__(self, path: str | Path, key: str = "checkpoint.load"):
        self.path, self.key = Path(path), key
        self.meta = read_meta(self.path)
        check_format(self.path, self.meta, key)

    @classmethod
    def open(cls, checkpoint: str | Path, key: str) -> "CheckpointModel":
        """The checkpoint ``checkpoint`` names (a ``step_*`` folder or a ``checkpoint.save`` root, whose
        newest intact one is taken), every file checked against its manifest first."""
        return cls(verified_checkpoint(checkpoint, key), key)

    @property
    def peft(self) -> Optional[dict]:
        """The ``peft`` block of meta.json (None: a full fine-tuning checkpoint)."""
        return self.meta.get("peft")

    def read_slices(self, sharded_state: dict) -> dict[str, torch.Tensor]:
        """The slices ``sharded_state`` (``resharding.sharded_state`` of this run's layout) asks for
        (collective over the ranks that read; train)."""
        from megatron_pack.training.checkpoint import checkpoint_reader
        from megatron_pack.training.resharding import load_sharded

        return load_sharded(sharded_state, checkpoint_reader(self.path))

    def stored_keys(self) -> set[str]:
        """Every tensor key the checkpoint's files hold (``model.<name>``, ``optimizer.<state>.<name>``, ...)."""
        from megatron_pack.training.checkpoint import checkpoint_reader

        return set(checkpoint_reader(self.path).read_metadata().state_dict_metadata)

    def shards(self) -> list[dict[str, torch.Tensor]]:
        """The whole model as the TP=1 model holds it, in one process, as one shard keyed by parameter
        name (``checkpoint.read_full_model``). Export and verify."""
        from megatron_pack.training.checkpoint import read_full_model

        return [read_full_model(self.path)]

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy the weights into a TP=1 model: all of its parameters, or a peft=lora checkpoint's adapters."""
        (full,) = self.shards()
        with torch.no_grad():
            for name, param in self._params(model):
                if name not in full:
                    raise ValueError(f"checkpoint {self.path} has no {name}: it was written for another model; "
                                     "use the same model.* settings as the training run.")
                if full[name].shape != param.shape:
                    raise ValueError(f"checkpoint {self.path}: {name} has shape {tuple(full[name].shape)}, the model "
                                     f"expects {tuple(param.shape)}; use the same model.* settings as the training run.")
                param.copy_(full[name])

    def _params(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters the checkpoint holds: all of them, or the LoRA adapters of a peft=lora run (and its
        vocabulary layers with ``model.resize_vocab``)."""
        from megatron_pack.model.peft.lora import is_adapter_param, is_vocab_param

        named = list(model.named_parameters())
        peft = self.peft
        has_adapters = any(is_adapter_param(n) for n, _ in named)
        if peft and not has_adapters:
            raise ValueError(f"checkpoint {self.path} holds LoRA adapters (peft=lora, dim {peft['dim']}, targets "
                             f"{peft['target_modules']}); add peft=lora with the same peft.* and "
                             f"model.pretrained={peft['base_model']}.")
        if has_adapters and not peft:
            raise ValueError(f"checkpoint {self.path} is a full fine-tuning checkpoint; drop peft=lora to load it.")
        if not peft:
            return named
        whole = bool(peft.get("modules_to_save"))  # model.resize_vocab: the vocabulary layers trained too
        return [(n, p) for n, p in named if is_adapter_param(n) or (whole and is_vocab_param(n))]

