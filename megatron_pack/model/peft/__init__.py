"""Parameter-efficient fine-tuning: LoRA on megatron-core's parallel linears (``peft=lora``), and
its export in the peft format or merged into the base (docs/peft.md).

``meta`` (``peft_meta``) needs no torch; ``lora`` (``apply_lora``, ``LoRAAdapter``, ...) imports torch and
megatron-core."""
