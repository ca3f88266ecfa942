"""The config ``train`` and ``verify`` run with: the command line, completed by what prepare recorded.

    cfg0 = compose(overrides)                       # presets + command line, not yet validated
    plan = choose_plan(cfg0, data.dataset_dir)      # data.plan, or the one plan that fits
    cfg  = load_config(overrides + recorded)        # + pack size, seq length, pad multiple, tokenizer,
                                                    #   vocab size, overflow policy the command line left unset
    validate(cfg, world_size, dataset_meta=plan metadata)

so ``megatron-pack verify data.dataset_dir=D`` works right after any ``prepare`` into ``D``. In-batch
packing (``packing.mode=in_batch``) has no plan: it reads the token store only.
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


def _store_meta(dataset_dir: Path, fix: str) -> dict:
    from megatron_pack.data.store.atomic import read_json

    if not (dataset_dir / "metadata.json").is_file():
        raise DataError(f"data.dataset_dir ({dataset_dir}) holds no prepared dataset; {fix}.")
    return read_json(dataset_dir / "metadata.json")


def load_run_config(overrides: list[str], *, config_dirs: Optional[list[str]] = None,
                    world_size: Optional[int] = None, open_data: bool = True) -> RunConfig:
    """``cfg`` for train/verify (module docstring); ``open_data=False`` skips opening the arrays
    (``--cfg job``). Raises ``ConfigError`` or ``DataError`` naming the key and the fix."""
    from megatron_pack.config.loader import compose_config, load_config
    from megatron_pack.data.store.recorded import (check_input_matches_store, choose_plan, given_keys,
                                                   recorded_overrides)

    from megatron_pack.config.validate import launch_problems

    given = given_keys(overrides)
    cfg0 = compose_config(overrides, config_dirs=config_dirs or ())
    early = launch_problems(cfg0, world_size=world_size)  # reported first: no dataset setting changes them
    if early:
        raise ConfigError(early)
    dataset_dir = Path(cfg0.data.dataset_dir)
    fix = (f"run `megatron-pack prepare data.dataset_dir={dataset_dir} ...` first (README.md, 'Commands'), or set "
           "data.dataset_dir to the folder prepare wrote")
    store_meta = _store_meta(dataset_dir, fix)
    problem = check_input_matches_store(cfg0, store_meta, dataset_dir)
    if problem:
        raise ConfigError([problem])
    if cfg0.packing.mode == "in_batch":
        return _in_batch_run(overrides, cfg0, store_meta, given, config_dirs, world_size, open_data)
    plan_dir = choose_plan(cfg0, dataset_dir, given)
    from megatron_pack.data.store.atomic import read_json

    plan_meta = read_json(plan_dir / "metadata.json")
    recorded = recorded_overrides(cfg0, plan_meta, store_meta, given)
    cfg = load_config(list(overrides) + recorded.overrides, config_dirs=config_dirs or (), world_size=world_size,
                      dataset_meta=plan_meta)
    notes = [f"from {plan_dir}: {n}" for n in recorded.notes]
    if not open_data:
        return RunConfig(cfg, None, notes)
    from megatron_pack.data.batches.opening import open_dataset

    dataset = open_dataset(cfg, plan_dir=plan_dir, check_tokenizer=recorded.check_tokenizer)
    return RunConfig(cfg, dataset, notes)


def _in_batch_run(overrides, cfg0, store_meta, given, config_dirs, world_size, open_data) -> RunConfig:
    """packing.mode=in_batch: no plan; the tokenizer and vocab size still come from the store."""
    from megatron_pack.config.loader import load_config
    from megatron_pack.data.store.recorded import recorded_overrides

    recorded = recorded_overrides(cfg0, {}, store_meta, given)
    meta = {"vocab_size": store_meta.get("vocab_size")}
    cfg = load_config(list(overrides) + recorded.overrides, config_dirs=config_dirs or (), world_size=world_size,
                      dataset_meta=meta)
    notes = [f"from {cfg.data.dataset_dir}: {n}" for n in recorded.notes]
    if not open_data:
        return RunConfig(cfg, None, notes)
    from megatron_pack.data.batches.opening import open_dataset

    return RunConfig(cfg, open_dataset(cfg, check_tokenizer=recorded.check_tokenizer), notes)
