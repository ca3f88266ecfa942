"""What a checkpoint records about ``peft.*`` (torch-free: the resume check reads it before launch)."""

from __future__ import annotations


def peft_meta(cfg) -> dict | None:
    """What a checkpoint records about ``cfg.peft`` (None for full fine-tuning): the adapter settings,
    the absolute path of the base model and, with ``model.resize_vocab``, the whole layers trained beside the
    adapters (peft's ``modules_to_save``), so export and resume need nothing else."""
    from pathlib import Path

    p = cfg.peft
    if p.method == "none":
        return None
    base = str(Path(cfg.model.pretrained).resolve()) if cfg.model.pretrained else None
    meta = {"method": p.method, "dim": p.dim, "alpha": p.alpha, "dropout": p.dropout,
            "target_modules": list(p.target_modules), "base_model": base}
    if cfg.model.resize_vocab:  # grown rows have no pretrained values: the vocabulary layers train whole
        meta["modules_to_save"] = vocab_modules(cfg.model.untie_embeddings_and_output_weights)
    return meta


def vocab_modules(untied: bool) -> list[str]:
    """peft's ``modules_to_save`` of a ``model.resize_vocab`` LoRA run: the embedding, and the output layer
    when it is its own tensor (tied, the embedding is the output layer)."""
    return ["embed_tokens", "lm_head"] if untied else ["embed_tokens"]
