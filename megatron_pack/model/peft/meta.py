"""What a checkpoint records about ``peft.*`` (torch-free: the resume check reads it before launch)."""

from __future__ import annotations


def peft_meta(cfg) -> dict | None:
    """What a checkpoint records about ``cfg.peft`` (None for full fine-tuning): the adapter settings
    and the absolute path of the base model, so export and resume need nothing else."""
    from pathlib import Path

    p = cfg.peft
    if p.method == "none":
        return None
    base = str(Path(cfg.model.pretrained).resolve()) if cfg.model.pretrained else None
    return {"method": p.method, "dim": p.dim, "alpha": p.alpha, "dropout": p.dropout,
            "target_modules": list(p.target_modules), "base_model": base}
