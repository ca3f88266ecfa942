"""The config ``train`` and ``verify`` run with: the command line, completed by what prepare recorded.

    cfg0 = compose(overrides)                       # presets + command line, not yet validated
    plan = choose_plan(cfg0, data.dataset_dir)      # data.plan, or the one plan whose manifest agrees
    cfg  = cfg0 + the plan's manifest               # every recorded setting the command line left unset
    validate(cfg, world_size, dataset_meta=plan metadata)

so ``megatron-pack verify data.dataset_dir=D`` works right after any ``prepare`` into ``D``. In-batch
packing (``packing.mode=in_batch``) has no plan: it reads the token store only, and so does online packing
with ``data.validation_fraction=0`` typed (otherwise the plan gives it its held-out validation samples); online
packing from a stream (``packing.online_source=stream``) reads nothing prepared. ``--cfg job`` before
the dataset is prepared prints the command line's config and says which values the dataset will set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_pack.config.schema import ConfigError
from megatron_pack.data.formats.sources import DataError


@dataclass
class RunConfig:
    """A validated config, the dataset it reads, and the lines saying what came from the dataset."""

    cfg: Any
    dataset: Any
    notes: list[str] = field(default_factory=list)
    plan_dir: Optional[Path] = None
    """The plan chosen (None: in-batch packing, or --cfg job before prepare)."""


def _store_meta(dataset_dir: Path) -> Optional[dict]:
    from megatron_pack.data.store.atomic import read_json

    if not (dataset_dir / "metadata.json").is_file():
        return None
    return read_json(dataset_dir / "metadata.json")


def load_run_config(overrides: list[str], *, config_dirs: Optional[list[str]] = None,
                    world_size: Optional[int] = None, open_data: bool = True, host: Any = None,
                    command: Optional[str] = None) -> RunConfig:
    """``cfg`` for train/verify (module docstring); ``open_data=False`` skips opening the arrays
    (``--cfg job``); ``host`` (``config.host.Host``) and ``command`` enable the rules that need them
    (``config.validate.RULES``). Raises ``ConfigError`` or ``DataError`` naming the key and the fix."""
    from megatron_pack.config.loader import compose_config
    from megatron_pack.config.validate import launch_problems
    from megatron_pack.data.store.recorded import apply_recorded, check_input_matches_store, choose_plan, given_keys

    given = given_keys(overrides)
    cfg0 = compose_config(overrides, config_dirs=config_dirs or ())
    checks = {"world_size": world_size, "host": host, "command": command}
    early = launch_problems(cfg0, **checks)  # reported first: no dataset setting changes them
    if early:
        raise ConfigError(early)
    if cfg0.packing.mode == "online" and cfg0.packing.online_source == "stream":
        return _stream_run(cfg0, checks, open_data, given)
    dataset_dir = Path(cfg0.data.dataset_dir)
    fix = (f"run `megatron-pack prepare data.dataset_dir={dataset_dir} ...` first (README.md, 'Commands'), or set "
           "data.dataset_dir to the folder prepare wrote")
    store_meta = _store_meta(dataset_dir)
    if store_meta is None:
        if not open_data:  # --cfg job before prepare: the command line's config, and what the dataset will set
            return _before_prepare(cfg0, given, dataset_dir, checks)
        raise DataError(f"data.dataset_dir ({dataset_dir}) holds no prepared dataset; {fix}.")
    problem = check_input_matches_store(cfg0, store_meta, dataset_dir)
    if problem:
        raise ConfigError([problem])
    if cfg0.packing.mode == "in_batch" or _online_without_validation(cfg0, given):
        return _store_run(cfg0, store_meta, given, checks, open_data)
    plan_dir = choose_plan(cfg0, dataset_dir, given)
    from megatron_pack.data.store.atomic import read_json

    plan_meta = read_json(plan_dir / "metadata.json")
    recorded = apply_recorded(cfg0, plan_meta, store_meta, given)
    cfg = _validated(recorded.cfg, checks, plan_meta)
    notes = [f"from {plan_dir}: {n}" for n in recorded.notes]
    if not open_data:
        return RunConfig(cfg, None, notes, plan_dir)
    from megatron_pack.data.batches.opening import open_dataset

    dataset = open_dataset(cfg, plan_dir=plan_dir, check_tokenizer=recorded.check_tokenizer)
    return RunConfig(cfg, dataset, notes, plan_dir)


def _validated(cfg, checks: dict, dataset_meta: Optional[dict]):
    from megatron_pack.config.validate import validate

    validate(cfg, dataset_meta=dataset_meta, **checks)
    return cfg


def _before_prepare(cfg0, given: set[str], dataset_dir: Path, checks: dict) -> RunConfig:
    """``--cfg job`` with nothing prepared yet: the config as the command line gives it, validated where it
    can be, and one line naming the keys the dataset will set once prepared."""
    from megatron_pack.config.validate import collect_problems
    from megatron_pack.data.store.manifest import ENTRIES

    later = [k for e in ENTRIES if e.taken for k in (e.key, *e.given_by) if k not in given]
    problems = [p for p in collect_problems(cfg0, **checks)
                if not any(p.startswith(k) for k in later)]  # a value the dataset will replace is not wrong yet
    if problems:
        raise ConfigError(problems)
    note = (f"data.dataset_dir ({dataset_dir}) is not prepared yet, so this is the command line's config; once "
            f"`megatron-pack prepare data.dataset_dir={dataset_dir} ...` has run, these come from the dataset "
            f"(unless set here): {', '.join(dict.fromkeys(later))}.")
    return RunConfig(cfg0, None, [note])


def _stream_run(cfg0, checks: dict, open_data: bool, given: set[str]) -> RunConfig:
    """packing.online_source=stream: the records of data.input are tokenized while training; nothing prepared
    is read, so the command line's config is the run's (a pretrained folder's vocabulary checked against the
    tokenizer's size, and grown with model.resize_vocab, as from a prepared dataset)."""
    cfg, notes = cfg0, []
    if cfg0.model.pretrained:
        from megatron_pack.config.validate import tokenizer_vocab_problems
        from megatron_pack.data.formats.tokenizer import build_tokenizer
        from megatron_pack.data.store.recorded import apply_recorded

        vocab = build_tokenizer(cfg0.data.tokenizer, cfg0.data.chat_template).vocab_size
        recorded = apply_recorded(cfg0, {}, {"vocab_size": vocab}, given)
        cfg, notes = recorded.cfg, [f"from data.tokenizer: {n}" for n in recorded.notes]
        problems = tokenizer_vocab_problems(cfg, vocab, f"len(tokenizer) = {vocab}")
        if problems:
            raise ConfigError(problems)
    cfg = _validated(cfg, checks, None)
    if not open_data:
        return RunConfig(cfg, None, notes)
    from megatron_pack.data.batches.opening import open_dataset

    return RunConfig(cfg, open_dataset(cfg), notes)


def _online_without_validation(cfg0, given: set[str]) -> bool:
    """Online packing from the store with ``data.validation_fraction=0`` typed and no other validation set: no
    plan is read (the one thing online packing takes from a plan is its held-out validation samples)."""
    d = cfg0.data
    return (cfg0.packing.mode == "online" and "data.validation_fraction" in given and not d.validation_fraction
            and d.validation is None and d.plan is None)


def _store_run(cfg0, store_meta, given, checks: dict, open_data) -> RunConfig:
    """packing.mode=in_batch, or online without a validation set: no plan; the tokenizer and vocab size still
    come from the store."""
    from megatron_pack.data.store.recorded import apply_recorded

    recorded = apply_recorded(cfg0, {}, store_meta, given)
    cfg = _validated(recorded.cfg, checks, {"vocab_size": store_meta.get("vocab_size"),
                                            **({"images": store_meta["images"]} if "images" in store_meta else {})})
    notes = [f"from {cfg.data.dataset_dir}: {n}" for n in recorded.notes]
    if not open_data:
        return RunConfig(cfg, None, notes)
    from megatron_pack.data.batches.opening import open_dataset

    return RunConfig(cfg, open_dataset(cfg, check_tokenizer=recorded.check_tokenizer), notes)
