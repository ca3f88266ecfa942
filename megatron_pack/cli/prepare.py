"""`megatron-pack prepare key=value ...`: tokenize once into a token store and write a packing plan.

Examples::

    megatron-pack prepare data=synthetic packing.packed_sequence_size=512 parallel.context_parallel_size=2
    megatron-pack prepare data=files data.input=train.jsonl data.tokenizer=/models/llama3 \\
        packing.packed_sequence_size=4096 packing.on_overflow=truncate export=bridge

Shorthands: ``export=bridge`` means ``packing.export=bridge``; ``input=PATH`` means
``data.source=files data.input=PATH``; ``tokenizer=X`` means ``data.tokenizer=X``; ``output=DIR``
means ``data.dataset_dir=DIR``. A pack size given without ``model.seq_length`` sets it too.
Under torchrun only global rank 0 writes.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from megatron_pack.config.schema import ConfigError

SHORTHANDS = {"export": ["packing.export={}"], "input": ["data.source=files", "data.input={}"],
              "tokenizer": ["data.tokenizer={}"], "output": ["data.dataset_dir={}"]}


def expand_shorthands(argv: list[str]) -> list[str]:
    """``export=bridge`` -> ``packing.export=bridge`` (and the other SHORTHANDS); other args unchanged.

    prepare never builds the model, so a pack size given without ``model.seq_length`` also sets
    it (the config requires them equal): ``packing.packed_sequence_size=4096`` adds
    ``model.seq_length=4096``; and ``model.seq_length`` given alone names the pack size too (as train
    reads it), unless packing.mode=in_batch (no packs).
    """
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        out += [t.format(value) for t in SHORTHANDS[key]] if sep and key in SHORTHANDS else [arg]
    keys = {a.partition("=")[0]: a.partition("=")[2] for a in out}
    if "packing.packed_sequence_size" in keys and "model.seq_length" not in keys:
        out.append(f"model.seq_length={keys['packing.packed_sequence_size']}")
    elif "model.seq_length" in keys and "packing.packed_sequence_size" not in keys and \
            keys.get("packing.mode") != "in_batch":
        out.append(f"packing.packed_sequence_size={keys['model.seq_length']}")
    return out


def _barrier():
    import torch.distributed as dist

    from megatron_pack.parallel.comm import barrier

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return barrier


def main(argv: list[str]) -> int:
    from megatron_pack.cli.args import parse_command_line, print_resolved
    from megatron_pack.cli.preflight import check_prepare
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare_record import record, unchanged_plan
    from megatron_pack.data.formats.sources import DataError
    from megatron_pack.data.store.atomic import read_json

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    line = parse_command_line("prepare", argv)
    if isinstance(line, int):
        return line
    cfg = None
    try:
        overrides = expand_shorthands(line.overrides)
        cfg = _with_recorded(load_config(overrides, config_dirs=line.config_dirs), overrides, rank)
        from megatron_pack.config.validate import prepare_problems

        if prepare_problems(cfg):
            raise ConfigError(prepare_problems(cfg))
        if line.print_config:
            return print_resolved(cfg)
        check_prepare(cfg)  # the tokenizer and model folders, one line each, before anything is read
        plan_dir = unchanged_plan(cfg) if world_size == 1 else None  # proved unchanged: no tokenizer is built
        if plan_dir is not None:  # what the run that wrote it warned, said again
            _check_vocab(cfg)
            _warn_lost(Path(cfg.data.dataset_dir), plan_dir)
        else:
            from megatron_pack.data.prepare import prepare

            barrier = _barrier() if world_size > 1 else None
            plan_dir = prepare(cfg, rank=rank, world_size=world_size, barrier=barrier, progress=rank == 0)
            if world_size == 1:
                record(cfg, plan_dir)
    except (ConfigError, DataError, FileNotFoundError, ImportError) as exc:
        print(f"megatron-pack prepare: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the half-built folders are gone already (atomic_directory)
        where = cfg.data.dataset_dir if cfg is not None else "data.dataset_dir"
        print(f"\nmegatron-pack prepare: interrupted (Ctrl-C); nothing was written to {where} (what it held "
              "before is unchanged); run the same command to start again.", file=sys.stderr)
        return 130
    if rank == 0:
        print("\n".join(summary_lines(cfg, plan_dir, read_json(Path(cfg.data.dataset_dir) / "metadata.json"),
                                       read_json(plan_dir / "metadata.json"))))
    return 0


def _with_recorded(cfg, overrides: list[str], rank: int):
    """``cfg`` completed from what the folder ``data.dataset_dir`` already holds (its plans' manifests), for every
    key the command line leaves unset, with one line naming the values taken."""
    from megatron_pack.data.store.recorded import apply_recorded_to_prepare, given_keys

    dataset_dir = Path(cfg.data.dataset_dir)
    if not (dataset_dir / "metadata.json").is_file():
        return cfg
    recorded = apply_recorded_to_prepare(cfg, dataset_dir, given_keys(overrides))
    if recorded.notes and rank == 0:
        print(f"settings from the dataset ({dataset_dir}): {', '.join(recorded.notes)}", file=sys.stderr)
    return recorded.cfg


def _check_vocab(cfg) -> None:
    """An unchanged plan builds no tokenizer: the vocabulary rule reads the tokenizer's size the store recorded."""
    from megatron_pack.config.validate import tokenizer_vocab_problems
    from megatron_pack.data.store.atomic import read_json

    vocab = read_json(Path(cfg.data.dataset_dir) / "metadata.json").get("vocab_size")
    problems = tokenizer_vocab_problems(cfg, vocab, f"len(tokenizer) = {vocab}") if cfg.model.pretrained else []
    if problems:
        raise ConfigError(problems)


def _warn_lost(dataset_dir: Path, plan_dir: Path) -> None:
    from megatron_pack.data.packing.report import plan_lost_warning
    from megatron_pack.data.store.atomic import read_json

    warning = plan_lost_warning(read_json(dataset_dir / "metadata.json"), read_json(plan_dir / "metadata.json"))
    if warning:
        logging.getLogger("megatron_pack.data.prepare").warning(warning)


def bad_record_lines(store_meta: dict) -> list[str]:
    """``skipped N bad record(s): reason n, ...`` and the first ones with their lines (empty when none)."""
    bad = store_meta.get("bad_records") or {}
    if not bad.get("num_skipped"):
        return []
    counts = ", ".join(f"{reason} {n}" for reason, n in bad["by_reason"].items())
    lines = [f"bad records: skipped {bad['num_skipped']} bad record(s): {counts} (data.on_bad_record=skip); "
             f"the first {len(bad['first'])}:"]
    return lines + [f"  {b['message']}" for b in bad["first"]]


def summary_lines(cfg, plan_dir: Path, store_meta: dict, meta: dict) -> list[str]:
    """What prepare prints when it is done: where, the packs, the accounting, what was kept and lost, the bad
    records, the report."""
    from megatron_pack.cli.inspect import validation_text
    from megatron_pack.data.packing.bridge import bridge_paths
    from megatron_pack.data.packing.report import lost_data_text

    acc = meta["accounting"]
    held_out = f", held out {acc['num_samples_held_out']}" if acc.get("num_samples_held_out") else ""
    validation = validation_text(plan_dir, meta)
    bridge = ([f"bridge:  {', '.join(str(p) for p in bridge_paths(plan_dir, meta['pack_size']))}"]
              if cfg.packing.export == "bridge" else [])
    return ([f"dataset: {cfg.data.dataset_dir}", f"plan:    {plan_dir}",
             f"packs: {meta['num_bins']} (lower bound {meta['lower_bound_bins']}), efficiency "
             f"{meta['packing_efficiency']}%, samples read {acc['num_samples_read']}, packed "
             f"{acc['num_samples_packed']}{held_out}, dropped {acc['num_samples_dropped']}, truncated "
             f"{acc['num_samples_truncated']}", f"data: {lost_data_text(meta['lost_data'])}"]
            + ([f"validation: {validation}"] if validation else [])
            + bad_record_lines(store_meta)
            + [f"report:  {plan_dir / 'report.json'}, {plan_dir / 'report.png'}"] + bridge)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
