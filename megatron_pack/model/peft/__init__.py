"""Parameter-efficient fine-tuning: LoRA on megatron-core's parallel linears (``peft=lora``), and
its export in the peft format or merged into the base (docs/peft.md).

``peft_meta`` needs no torch; the LoRA names import ``lora`` (torch, megatron-core) when first used."""

from megatron_pack.model.peft.meta import peft_meta

__all__ = ["LoRAAdapter", "adapter_state", "apply_lora", "count_parameters", "peft_meta"]


def __getattr__(name: str):
    if name in ("LoRAAdapter", "adapter_state", "apply_lora", "count_parameters"):
        import importlib

        return getattr(importlib.import_module(f"{__name__}.lora"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
