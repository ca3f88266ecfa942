"""Which checkpoint a run starts from, and whether it may: checked before launch (torch-free).

``train --check`` (the launch scripts) and every rank before its process group call
:func:`check_resume`; the trainer calls :func:`resume_choice` again with the checksums verified
over its ranks (``checkpoint.collective_verify``). The choice, for ``checkpoint.save`` S and
``checkpoint.load`` L:

| settings                               | starts from                                                   |
|----------------------------------------|---------------------------------------------------------------|
| neither holds a checkpoint             | a fresh run                                                   |
| S holds one                            | S's newest intact checkpoint, in full (a damaged newer one is |
|                                        | passed over, named in a line)                                 |
| L set                                  | L's newest intact checkpoint, in full (the same)              |
| L is one checkpoint (``step_*``)       | that checkpoint, in full (damaged: refused, never passed over)|
| L + ``load_weights_only``              | the weights of L's newest checkpoint (damaged: refused)       |
| L + ``load_weights_only``, S holds one | S's newest intact checkpoint, in full (the run was restarted) |

Checkpoints are there but none is intact: refused (``ConfigError``), never a silent fresh start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_pack.config.schema import Config, ConfigError
from megatron_pack.training.checkpoint_files import (META, OlderCheckpoint, candidates, check_format,
                                                     choose_checkpoint, read_meta, sizes_only)


def resolve_train_iters(cfg: Config, steps) -> int:
    """Optimizer steps of the run: ``train.train_iters``, or the steps ``train.num_epochs`` epochs take
    (``steps``: a ``protocol.BatchLoader`` or the ``steps.StepPlanner`` of ``loader.step_planner``, whose
    ``num_steps`` counts them: 103 packs, dp 2, global batch 8, 2 epochs -> 2 * 102 // 8 = 25 steps)."""
    t = cfg.train
    if t.train_iters is not None:
        return t.train_iters
    iters = steps.num_steps(t.num_epochs)
    if iters is None:  # validate() refuses train.num_epochs with packing.mode=online
        raise ConfigError([f"train.num_epochs ({t.num_epochs}) needs the steps of an epoch counted up front, which "
                           "this loader does not do; set train.train_iters instead."])
    if iters < 1:
        batch = (f"train.global_batch_tokens={t.global_batch_tokens}" if t.global_batch_tokens is not None
                 else f"train.global_batch_size={t.global_batch_size}")
        raise ConfigError([f"train.num_epochs ({t.num_epochs}) over {steps.packs_per_epoch} packs per epoch is less "
                           f"than one global batch ({batch}); raise train.num_epochs, lower "
                           f"{batch.split('=')[0]}, or prepare more data."])
    return iters


def planned_train_iters(cfg: Config, dataset, world_size: int) -> int:
    """The run's steps (``resolve_train_iters``) for the opened ``dataset`` on ``world_size`` ranks,
    counted before any process group starts, so ``train.num_epochs`` is refused (``ConfigError``,
    one line) before ``build_trainer``. Online packing has ``train.train_iters`` (validate())."""
    if cfg.train.train_iters is not None:  # before the loader's import: `train --check` imports no torch
        return cfg.train.train_iters
    from megatron_pack.data.batches import loader as loader_lib
    from megatron_pack.parallel.dims import ParallelDims

    dp_size = ParallelDims.from_config(cfg, world_size).dp
    return resolve_train_iters(cfg, loader_lib.step_planner(cfg, dataset, dp_size))


def run_settings(cfg: Config, train_iters: int, plan_fingerprint: Optional[str]) -> dict[str, Any]:
    """What a resume must not change silently: learning rate and schedule, optimizer, global batch, data."""
    t = cfg.train
    return {"train.lr": t.lr, "train.min_lr": t.min_lr, "train.lr_warmup_iters": t.lr_warmup_iters,
            "train.lr_decay_style": t.lr_decay_style, "train iterations (resolved)": train_iters,
            "train.weight_decay": t.weight_decay, "train.adam_beta1": t.adam_beta1, "train.adam_beta2": t.adam_beta2,
            "train.adam_eps": t.adam_eps, "train.clip_grad": t.clip_grad,
            "train.global_batch_size": t.global_batch_size, "train.seed": t.seed, "data plan": plan_fingerprint}


DATA_SETTINGS = ("train.seed", "data plan")
"""Settings that define the pack order: when they change, the data position starts over."""


def changed_settings(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``["train.lr: 0.003 -> 0.001", ...]`` for every setting recorded in ``saved`` that differs."""
    return [f"{key}: {saved[key]!r} -> {value!r}" for key, value in now.items() if key in saved and saved[key] != value]


def check_resume_settings(cfg: Config, path: Path, now: dict[str, Any]) -> list[str]:
    """Refuse (``ConfigError``) resuming ``path`` with changed settings unless ``checkpoint.allow_changed``;
    returns the changes (printed by the caller when allowed)."""
    changes = changed_settings(read_meta(path).get("settings", {}), now)
    if changes and not cfg.checkpoint.allow_changed:
        raise ConfigError([f"resuming {path} with changed settings ({'; '.join(changes)}); set "
                           "checkpoint.allow_changed=true to go on with the new values, restore the old ones, or set "
                           "checkpoint.load_weights_only=true to start a new run from its weights."])
    return changes


@dataclass
class ResumeChoice:
    """The checkpoint a run starts from and how."""

    save: Path
    """Where the run saves (checkpoint.save, or <train.output_dir>/checkpoints)."""
    path: Optional[Path] = None
    """The checkpoint read (None: a fresh start)."""
    kind: str = "fresh"
    """'fresh', 'resume' (model, optimizer, schedule, data position) or 'weights' (the model only)."""
    skipped: list[str] = field(default_factory=list)
    """One line per newer checkpoint passed over because it is damaged or incomplete."""


def save_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.save or Path(cfg.train.output_dir) / "checkpoints")


def resume_choice(cfg: Config, verify: Callable[[Path], list[str]] = sizes_only) -> ResumeChoice:
    """What the run starts from (the module docstring's table); ``verify`` finds a checkpoint's
    problems (sizes only before launch; sizes and checksums, over the ranks, in the trainer)."""
    save = save_dir(cfg)
    own, own_skipped = choose_checkpoint(save, verify)
    passed = [f"passed over: {line}" for line in own_skipped]
    load = cfg.checkpoint.load
    if own is not None and (load is None or cfg.checkpoint.load_weights_only):
        return ResumeChoice(save, own, "resume", passed)
    if load is None:
        if own_skipped:
            raise ConfigError([f"checkpoint.save ({save}) holds checkpoints but none is intact: {own_skipped[0]}; "
                               "restore the damaged files, or move the folder away to start fresh (nothing was "
                               "started)."])
        return ResumeChoice(save)
    if is_checkpoint_folder(load):
        return ResumeChoice(save, _chosen_folder(Path(load), verify), kind_of_load(cfg))
    found, skipped = choose_checkpoint(load, verify)
    if cfg.checkpoint.load_weights_only and skipped:
        older = f" ({found.name} there is intact: move the damaged one away to start from it)" if found else ""
        raise ConfigError([f"checkpoint.load ({load}): {skipped[0]}; checkpoint.load_weights_only starts from the "
                           f"newest checkpoint and does not pass over a damaged one{older}."])
    if found is None:
        why = f": {skipped[0]}" if skipped else " (no 'latest' or step_*/meta.json)"
        raise ConfigError([f"checkpoint.load ({load}) holds no complete checkpoint{why}; fix the path or unset "
                           "checkpoint.load."])
    return ResumeChoice(save, found, kind_of_load(cfg), [f"passed over: {line}" for line in skipped])


def kind_of_load(cfg: Config) -> str:
    return "weights" if cfg.checkpoint.load_weights_only else "resume"


def is_checkpoint_folder(path: str | Path) -> bool:
    """``path`` is one checkpoint (a ``step_*`` folder with its ``meta.json``), not a folder of them."""
    return (Path(path) / META).is_file()


def _chosen_folder(folder: Path, verify: Callable[[Path], list[str]]) -> Path:
    """The one checkpoint ``checkpoint.load`` names, intact: a damaged one is refused, never passed over
    (the user chose it); an intact one beside it is named as the way on."""
    problems = verify(folder)
    if not problems:
        return folder
    intact = next((c for c in candidates(folder.parent) if c != folder and not sizes_only(c)), None)
    instead = f"; {intact.name} beside it is intact: checkpoint.load={intact}" if intact else ""
    raise ConfigError([f"checkpoint.load ({folder}): {problems[0]}, so it is refused (nothing was started){instead}."])


def checkpoint_dirs(cfg: Config) -> tuple[Path, Optional[Path]]:
    """(where to save, what to resume from or None): ``resume_choice``'s, sizes checked."""
    choice = resume_choice(cfg)
    return choice.save, choice.path


def layout_meta(world_size: int, tp: int, cp: int, dp: int, ep: int = 1, vp: int = 1) -> dict:
    """The parallel layout a checkpoint records in ``meta.json`` and a resume must match (the pipeline
    size follows from the others; ``vp``: model chunks per pipeline rank)."""
    return {"world_size": world_size, "tensor_model_parallel_size": tp, "context_parallel_size": cp,
            "data_parallel_size": dp, "expert_model_parallel_size": ep, "virtual_pipeline_model_parallel_size": vp}


_LAYOUT_DEFAULTS = {"expert_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": 1}
"""What a checkpoint written before a layout key existed had (no expert parallelism, one chunk per rank)."""


def same_layout(meta: dict, here: dict) -> bool:
    """``meta.json``'s layout is ``here`` (a key it lacks has its default, ``_LAYOUT_DEFAULTS``)."""
    return all(meta.get(k, _LAYOUT_DEFAULTS.get(k)) == v for k, v in here.items())


def check_resume(cfg: Config, world_size: int, dataset=None, notes: Optional[list[str]] = None) -> Optional[Path]:
    """The checkpoint this run starts from (None: a fresh start), checked before any process
    group exists; what the run cannot do raises ``ConfigError`` (printed once by the entry,
    exit 2) instead of failing on every rank inside ``Trainer.load``:

    - ``checkpoint.load`` holds no checkpoint; a damaged checkpoint where the run may not pass over
      it (``resume_choice``), whose lines for the ones it passed over are appended to ``notes``;
    - a checkpoint of another format (written by an older megatron_pack: ``check_format``);
    - online packing at another data-parallel size or ``data.num_workers`` (its shards depend on both);
    - with ``dataset`` (the opened training plan): ``train.num_epochs`` that gives less than one
      step (``planned_train_iters``), and a full resume with changed lr, schedule, optimizer,
      global batch, seed or data plan, unless ``checkpoint.allow_changed``.

    A checkpoint resumes at any layout on every device (weights and optimizer state by global identity); a
    weights-only start (``checkpoint.load_weights_only``) reads the weights at any layout."""
    from megatron_pack.parallel.dims import ParallelDims

    iters = planned_train_iters(cfg, dataset, world_size) if dataset is not None else None
    choice = resume_choice(cfg)
    if notes is not None:
        notes += choice.skipped
    resume, kind = choice.path, choice.kind
    if resume is None:
        return None
    saved = read_meta(resume)
    key = "checkpoint.load" if cfg.checkpoint.load is not None else "checkpoint.save (or train.output_dir)"
    try:
        check_format(resume, saved, key)
    except OlderCheckpoint as exc:
        raise ConfigError([str(exc)]) from None
    dims = ParallelDims.from_config(cfg, world_size)
    if kind == "resume" and not _holds_optimizer_state(resume):
        raise ConfigError([f"cannot resume from {resume}: it holds no optimizer state by parameter (a GPU run of "
                           "an older megatron_pack kept megatron-core's per-rank state, without Adam moments); set "
                           f"checkpoint.load_weights_only=true to start a new run from its weights, or set {key} to "
                           "another directory to start fresh."])
    _check_resume_peft(cfg, resume, saved)
    loader_state = saved.get("train_state", {}).get("loader") or {}
    if kind == "resume" and cfg.packing.mode == "online" and loader_state.get("kind") == "online":
        from megatron_pack.data.batches.online import online_packing_record, online_resume_problem

        problem = online_resume_problem(loader_state, dp_size=dims.dp, num_workers=cfg.data.num_workers,
                                        packing=online_packing_record(cfg),
                                        fresh=f"set {key} to another directory to start fresh")
        if problem:
            raise ConfigError([f"cannot resume from {resume}: {problem}"])
    if dataset is not None and kind == "resume":
        check_resume_settings(cfg, resume, run_settings(cfg, iters, dataset.metadata.get("fingerprint")))
    return resume


def _holds_optimizer_state(path: Path) -> bool:
    """Whether checkpoint ``path``'s tensors include Adam moments (its DCP index, read through the allowlist;
    a folder without one is judged by its manifest check instead)."""
    from megatron_pack.training.checkpoint import checkpoint_reader

    if not (path / ".metadata").is_file():
        return True
    keys = checkpoint_reader(path).read_metadata().state_dict_metadata
    return any(key.startswith("optimizer.exp_avg.") for key in keys)


def _check_resume_peft(cfg: Config, resume: Path, saved: dict) -> None:
    """A LoRA checkpoint resumes only as the same LoRA run (adapters only, on the recorded base)."""
    from megatron_pack.model.peft.meta import peft_meta

    want, have = peft_meta(cfg), saved.get("peft")
    if want != have:
        key = "checkpoint.load" if cfg.checkpoint.load is not None else "checkpoint.save (or train.output_dir)"
        raise ConfigError([f"cannot resume from {resume}: it was written with peft {have!r}, this run has peft "
                           f"{want!r}; resume with the same peft.* and model.pretrained, or set {key} to another "
                           "directory to start fresh."])
