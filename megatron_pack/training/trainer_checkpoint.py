"""Save a Trainer, resume it, or start from a checkpoint's weights: the resume policy in action.

What a checkpoint holds (``checkpoint.py`` writes the files): the model chunks' parameters and the
optimizer's per-parameter state by global identity (``resharding.sharded_state``, so any layout
resumes it), ``meta.json`` with the layout, the peft settings, the run's settings and its position
(``train_state``: step, schedule, loader, consumed samples and tokens, elapsed time, validation
history), and one small file per rank (RNG states, that DP rank's own loader position). The optimizer is
megatron-core's on every device (``optim.TrainOptimizer``): its Adam moments, step and fp32 main params are in
the sharded state, so a run resumes them at any layout, with the distributed optimizer on or off. :func:`start_or_resume` applies the choice of ``resume.resume_choice``
(which checkpoint, in full or weights only); weights are read through ``model_reader.CheckpointModel``,
the reader verify and export use too. ``trainer`` below is a ``loop.Trainer`` (not imported: the
loop imports this module).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_pack.config.schema import Config
from megatron_pack.parallel.groups import ParallelState
from megatron_pack.training import checkpoint as ckpt
from megatron_pack.training.chunks import chunk_prefix, core_model
from megatron_pack.training.model_reader import CheckpointModel
from megatron_pack.training.resume import (DATA_SETTINGS, _check_resume_peft, check_resume_settings, layout_meta,
                                           resume_choice, run_settings, same_layout)

log = logging.getLogger("megatron_pack.train")


def should_save(cfg: Config, step: int, train_iters: int) -> bool:
    """``checkpoint.save_interval`` steps, and the run's last step."""
    c = cfg.checkpoint
    return c.enabled and (step == train_iters or (c.save_interval > 0 and step % c.save_interval == 0))


def layout(state: ParallelState, num_model_chunks: int = 1) -> dict:
    """The layout meta.json records (and a same-layout resume compares)."""
    return layout_meta(state.world_size, state.tp_size, state.cp_size, state.dp_size, state.dims.ep, num_model_chunks)


def _lora(cfg: Config) -> bool:
    """peft=lora: checkpoints hold the trainable adapters only (the frozen base is re-read from
    model.pretrained, whose path meta.json records)."""
    return cfg.peft.method != "none"


def settings(trainer) -> dict[str, Any]:
    """The run's settings a resume compares (``resume.run_settings``)."""
    return run_settings(trainer.cfg, trainer.train_iters, trainer.plan_fingerprint)


def _sharded_state(trainer, *, with_optimizer: bool, stored: Optional[set[str]] = None) -> dict:
    """Every model chunk's parameters (and their optimizer state), by global identity. ``stored`` (loading: the
    checkpoint's keys) leaves out fp32 main params the checkpoint does not hold (written by a run without
    bf16: the main params then start from the weights)."""
    from megatron_pack.training.resharding import sharded_state, stored_in

    lora = _lora(trainer.cfg)
    if not with_optimizer:
        return sharded_state(trainer.model_chunks, {}, trainable_only=lora)
    tensors, step = trainer.optimizer.checkpoint_tensors()
    state = sharded_state(trainer.model_chunks, tensors, step, trainable_only=lora)
    if stored is not None:
        state = {k: v for k, v in state.items() if not k.startswith("optimizer.fp32_param.") or stored_in(v, stored)}
    return state


def _has_extra_state(module: torch.nn.Module) -> bool:
    return type(module).get_extra_state is not torch.nn.Module.get_extra_state


def module_extra_states(chunks) -> dict[str, Any]:
    """``{module name: module.get_extra_state()}`` of every module of this rank's chunks that keeps extra
    state (Transformer Engine's layers: their FP8 metadata, the amax history and scales of delayed scaling).
    It is this rank's own (reduced over the groups by TE as it trains), so it travels in the rank file."""
    out: dict[str, Any] = {}
    for v, chunk in enumerate(chunks):
        for name, module in core_model(chunk).named_modules():
            if _has_extra_state(module):
                state = module.get_extra_state()
                if state is not None:
                    out[chunk_prefix(v, len(chunks)) + name] = state
    return out


def restore_extra_states(chunks, states: dict[str, Any]) -> int:
    """``set_extra_state`` on every module ``states`` names (from :func:`module_extra_states`); returns how many."""
    num_set = 0
    for v, chunk in enumerate(chunks):
        for name, module in core_model(chunk).named_modules():
            key = chunk_prefix(v, len(chunks)) + name
            if key in states and _has_extra_state(module):
                module.set_extra_state(states[key])
                num_set += 1
    return num_set


def _train_state(trainer) -> dict:
    """The run's position, the same on every rank: written once, in meta.json."""
    elapsed = trainer.history[-1].elapsed_s if trainer.history else trainer.elapsed_before_s
    return {"step": trainer.step, "schedule": trainer.schedule.state_dict(), "loader": trainer.loader.state_dict(),
            "consumed_samples": trainer.consumed_samples, "consumed_target_tokens": trainer.consumed_target_tokens,
            "elapsed_s": elapsed, "val_history": trainer.val_history}


def save_trainer(trainer, root: str | Path) -> Path:
    """Collectively write a checkpoint any layout can resume (see docs/training.md); returns its folder."""
    from megatron_pack.model.peft.meta import peft_meta

    sharded = _sharded_state(trainer, with_optimizer=True)
    meta = {**layout(trainer.state, len(trainer.model_chunks)), "peft": peft_meta(trainer.cfg),
            "train_state": _train_state(trainer), "settings": settings(trainer)}
    # each DP rank's own loader position too (online buffers and planned steps differ per rank);
    # meta.json's copy (rank 0's) is the layout-free position used when the layout changes
    rank_state = {"rng": ckpt.rng_state(trainer.state.device),
                  "loader": trainer.loader.state_dict(), "extra_state": module_extra_states(trainer.model_chunks)}
    return ckpt.save_checkpoint(root, trainer.step, sharded_state=sharded, rank_state=rank_state, meta=meta,
                                keep_last=trainer.cfg.checkpoint.keep_last)


def _copy_model(trainer, loaded: dict[str, torch.Tensor]) -> None:
    lora = _lora(trainer.cfg)
    chunks = trainer.model_chunks
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            for name, param in core_model(chunk).named_parameters():
                if param.requires_grad or not lora:
                    param.copy_(loaded[f"model.{chunk_prefix(v, len(chunks))}{name}"])


def load_trainer_weights(trainer, path: str | Path) -> None:
    """Model weights of checkpoint ``path`` (any layout); optimizer, schedule, data and step stay fresh."""
    reader = CheckpointModel(path)
    _copy_model(trainer, reader.read_slices(_sharded_state(trainer, with_optimizer=False)))


def load_trainer(trainer, path: str | Path) -> list[str]:
    """Resume from checkpoint ``path`` written at any layout; returns the settings that changed
    (refused unless ``checkpoint.allow_changed``)."""
    reader = CheckpointModel(path)
    meta = reader.meta
    _check_resume_peft(trainer.cfg, reader.path, meta)
    changes = check_resume_settings(trainer.cfg, reader.path, settings(trainer))
    here = layout(trainer.state, len(trainer.model_chunks))
    same = same_layout(meta, here)
    sharded = _sharded_state(trainer, with_optimizer=True, stored=reader.stored_keys())
    loaded = reader.read_slices(sharded)
    _copy_model(trainer, loaded)
    trainer.optimizer.load_checkpoint_tensors(_optimizer_tensors(loaded), loaded.get("optimizer.step", torch.zeros(())))
    rank_state = ckpt.read_rank_state(path) if same else None
    if rank_state is not None:
        ckpt.set_rng_state(rank_state["rng"], trainer.state.device)
        restore_extra_states(trainer.model_chunks, rank_state.get("extra_state") or {})
    elif module_extra_states(trainer.model_chunks):
        log.warning("resumed %s at another layout: Transformer Engine's per-rank FP8 scaling history "
                    "(_extra_state) starts over; the weights and optimizer state are resumed", path)
    train_state = dict(meta["train_state"])
    loader_state = rank_loader_state(trainer.state, path, meta, rank_state)
    if loader_state is not None:
        train_state["loader"] = loader_state
    _apply_train_state(trainer, train_state, changes)
    return changes


def _optimizer_tensors(loaded: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """``{"optimizer.<state>.<name>": t}`` -> ``{name: {state: t}}`` (the step is kept apart)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in loaded.items():
        if key.startswith("optimizer.") and key != "optimizer.step":
            state, name = key[len("optimizer."):].split(".", 1)
            out.setdefault(name, {})[state] = tensor
    return out


def rank_loader_state(state: ParallelState, path: str | Path, meta: dict, rank_state: Optional[dict]) -> Optional[dict]:
    """This DP rank's own loader state: from its rank file at the same layout; at another TP/CP
    layout with the same DP size, from the file of the old rank with this DP rank (TP and CP rank
    0; megatron-core's rank order tp-cp-ep-dp-pp). None: meta.json's (rank 0's, layout-free) is used."""
    if rank_state is not None:
        return rank_state.get("loader")
    if meta.get("data_parallel_size") != state.dp_size:
        return None
    old_rank = state.dp_rank * int(meta["tensor_model_parallel_size"]) * int(meta["context_parallel_size"])
    old = ckpt.read_rank_state(path, old_rank)
    return old.get("loader") if old is not None else None


def _apply_train_state(trainer, state: dict, changes: list[str]) -> None:
    trainer.step = int(state["step"])
    trainer.schedule.load_state_dict(state["schedule"])
    if any(change.split(":")[0] in DATA_SETTINGS for change in changes):
        log.warning("the data plan or train.seed changed: the data order starts over at its first pack")
    else:
        trainer.loader.load_state_dict(state["loader"])
    trainer.consumed_samples = int(state["consumed_samples"])
    trainer.consumed_target_tokens = int(state["consumed_target_tokens"])
    trainer.elapsed_before_s = float(state["elapsed_s"])
    trainer.val_history = [list(v) for v in state.get("val_history", [])]
    trainer.data_iterator = None


def start_or_resume(cfg: Config, trainer) -> Optional[Path]:
    """Resume from the newest intact checkpoint (any layout; its files' checksums verified over the
    ranks, a damaged newer one passed over with a warning), or start from checkpoint.load's weights;
    returns the checkpoint read (None: a fresh start)."""
    choice = resume_choice(cfg, verify=ckpt.collective_verify())
    for line in choice.skipped:
        log.warning("%s", line)
    resume, kind = choice.path, choice.kind
    if kind == "fresh":
        return None
    if kind == "weights":
        trainer.load_weights(resume)
        log.info("started a new run from the weights of %s (fresh optimizer, schedule and data order)", resume)
        return resume
    changes = trainer.load(resume)
    for change in changes:
        log.warning("resumed with a changed setting (checkpoint.allow_changed=true): %s", change)
    # samples, not step * global_batch_size packs: token budgets and online steps vary their pack count
    log.info("resumed from %s at step %d (%d samples consumed)", resume, trainer.step, trainer.consumed_samples)
    return resume
