"""`megatron-pack export`: a checkpoint (or a pretrained folder) -> a Hugging Face folder.

    megatron-pack export checkpoint=runs/sft/checkpoints/step_00000100 output=exports/sft-100
    megatron-pack export checkpoint=runs/sft/checkpoints output=exports/sft-latest export.dtype=bfloat16
    megatron-pack export model.pretrained=models/Llama-3.2-1B output=exports/roundtrip   # no checkpoint
    megatron-pack export checkpoint=runs/lora/checkpoints output=exports/lora export.adapter=true  # peft adapter
    megatron-pack export checkpoint=runs/lora/checkpoints output=exports/lora-merged export.merge=true

``checkpoint=`` and ``output=`` are short for ``export.checkpoint=`` / ``export.output=``. A
checkpoint of a run started from ``model.pretrained`` carries that folder's config.json and the
tokenizer the data was tokenized with, with the chat template it was rendered with, in
``<checkpoint.save>/hf_source/``; pass ``model.pretrained=DIR`` to use another copy. With
``data.dataset_dir=D`` (and ``data.plan=NAME`` where D holds several plans) the export's tokenizer
gets the chat template that plan was prepared with (``data.chat_template``, from its manifest).
Runs in one process, whatever TP / CP / DP layout wrote the checkpoint. The dtype written is the
source folder's unless ``export.dtype`` says otherwise; shards are capped at
``export.max_shard_size``. A ``peft=lora`` checkpoint holds adapters only: ``export.adapter=true``
writes them in the peft format (``PeftModel.from_pretrained(base, DIR)``), ``export.merge=true``
merges them into the base it was trained from (recorded in the checkpoint; ``model.pretrained=``
names another copy) and writes a full model.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

_SHORT = {"checkpoint": "export.checkpoint", "output": "export.output"}


def _expand(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        out.append(f"{_SHORT[key]}={value}" if sep and key in _SHORT else arg)
    return out


def _given(argv: list[str], key: str) -> str | None:
    found = [a.split("=", 1)[1] for a in argv if a.startswith(key + "=")]
    return found[-1] if found else None


def resolve_checkpoint(path: str) -> Path:
    """A ``step_*`` folder, or the newest one under a ``checkpoint.save`` root, verified against its
    manifest (every file's size and sha256, model and optimizer parts alike)."""
    from megatron_pack.training.checkpoint_files import verified_checkpoint

    return verified_checkpoint(path, "export.checkpoint")


def _latest_or_none(path: str) -> Path | None:
    try:
        return resolve_checkpoint(path)
    except FileNotFoundError:
        return None


def _hf_source(step_dir: Path) -> Path:
    from megatron_pack.model.hf.export import HF_SOURCE

    for candidate in (step_dir.parent / HF_SOURCE, step_dir / HF_SOURCE):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(f"export.checkpoint ({step_dir}) has no {HF_SOURCE}/ beside it (the run did not start from "
                            "model.pretrained); pass model.pretrained=<the Hugging Face folder it was trained from>.")


def read_model_shards(step_dir: Path) -> list[dict]:
    """The whole model of checkpoint ``step_dir`` in one process, whatever layout wrote it
    (``training.model_reader``)."""
    from megatron_pack.training.model_reader import CheckpointModel

    return CheckpointModel(step_dir, "export.checkpoint").shards()


def run_export(argv: list[str], *, out=print, config_dirs: list[str] | None = None,
               print_config: bool = False) -> int:
    from megatron_pack.cli.args import print_resolved
    from megatron_pack.cli.preflight import check_weights_folder
    from megatron_pack.config import load_config
    from megatron_pack.config.schema import ConfigError, parse_size
    from megatron_pack.model.hf.export import export_folder

    argv = _expand(argv)
    checkpoint = _given(argv, "export.checkpoint")
    if print_config and checkpoint and _latest_or_none(checkpoint) is None:  # --cfg job before the run wrote it
        return print_resolved(load_config(argv, config_dirs=config_dirs or []),
                              f"export.checkpoint ({checkpoint}) holds no checkpoint yet, so this is the command line's "
                              "config; once it does, model.pretrained comes from its hf_source/.")
    step_dir = resolve_checkpoint(checkpoint) if checkpoint else None
    given_base = _given(argv, "model.pretrained")
    if step_dir is not None and _given(argv, "model.pretrained") is None:
        argv = argv + [f"model.pretrained={_hf_source(step_dir)}"]
    cfg = load_config(argv, config_dirs=config_dirs or [])
    if print_config:
        return print_resolved(cfg)
    if cfg.export.output is None:
        raise ConfigError(["export.output (None) is required; add output=DIR (a new folder for the Hugging Face model)."])
    if cfg.model.pretrained is None:
        raise ConfigError(["megatron-pack export needs checkpoint=RUN/checkpoints[/step_N] (a run started from "
                           "model.pretrained) or model.pretrained=DIR (a round trip of that folder)."])
    output = Path(cfg.export.output)
    if output.exists() and any(output.iterdir()):  # before reading anything
        raise FileExistsError(f"export.output ({output}) exists and is not empty; choose a new folder (nothing is "
                              "overwritten).")
    template = _dataset_template(cfg, argv)  # before anything is written
    if cfg.export.adapter or cfg.export.merge or (step_dir is not None and _checkpoint_peft(step_dir)):
        return _export_lora(cfg, step_dir, given_base, out, template)
    if step_dir is None:  # a round trip reads the folder's weights
        check_weights_folder(cfg.model.pretrained)
    shards = read_model_shards(step_dir) if step_dir is not None else None
    files, dtype = export_folder(output=cfg.export.output, source=cfg.model.pretrained, model_cfg=cfg.model,
                                 shards=shards, dtype=cfg.export.dtype,
                                 max_shard_bytes=parse_size(cfg.export.max_shard_size))
    what = f"checkpoint {step_dir}" if step_dir else f"{cfg.model.pretrained} (round trip, no checkpoint)"
    _write_template(cfg, template, out)
    out(f"export: {what} -> {cfg.export.output} ({dtype}, {len(files)} files: {', '.join(files)})")
    out(f"load it with: transformers.{_auto_class(cfg.model)}.from_pretrained({str(cfg.export.output)!r})")
    return 0


def _auto_class(model_cfg) -> str:
    """The transformers auto class of the exported model (a vision-language model takes images too)."""
    return "AutoModelForImageTextToText" if model_cfg.mrope_section is not None else "AutoModelForCausalLM"


def _dataset_template(cfg, argv: list[str]) -> Optional[dict]:
    """With data.dataset_dir / data.plan on the command line: the chat template the chosen plan was prepared
    with (its manifest's data.chat_template; None when it kept the tokenizer's), and the plan's name."""
    from megatron_pack.data.store.atomic import read_json
    from megatron_pack.data.store.recorded import choose_plan, given_keys

    given = given_keys(argv)
    if not {"data.dataset_dir", "data.plan"} & given:
        return None
    plan_dir = choose_plan(cfg, Path(cfg.data.dataset_dir), given)
    template = read_json(plan_dir / "metadata.json")["manifest"].get("data.chat_template")
    return {**template, "plan": plan_dir.name} if template else None


def _write_template(cfg, template: Optional[dict], out) -> None:
    from megatron_pack.model.hf.export import set_chat_template

    if template and set_chat_template(cfg.export.output, template["text"]):
        out(f"export: chat template {template['path']} (the one {template['plan']} was prepared with) -> "
            f"{Path(cfg.export.output) / 'tokenizer_config.json'}")


def _checkpoint_peft(step_dir: Path) -> dict | None:
    """The ``peft`` block of a checkpoint's meta.json (None: a full fine-tuning checkpoint)."""
    from megatron_pack.training.model_reader import CheckpointModel

    return CheckpointModel(step_dir, "export.checkpoint").peft


def _export_lora(cfg, step_dir: Path | None, given_base: str | None, out, template: Optional[dict]) -> int:
    """export.adapter / export.merge of a peft=lora checkpoint (model/peft/export.py)."""
    from megatron_pack.cli.preflight import check_weights_folder
    from megatron_pack.config.schema import ConfigError, parse_size
    from megatron_pack.model.peft.export import base_folder, export_adapter, export_merged

    if step_dir is None:
        raise ConfigError(["export.adapter / export.merge need checkpoint=RUN/checkpoints[/step_N] of a peft=lora run."])
    peft = _checkpoint_peft(step_dir)
    if not peft:
        raise ValueError(f"export.adapter / export.merge: checkpoint {step_dir} is a full fine-tuning checkpoint "
                         "(no LoRA adapters); drop export.adapter / export.merge to export the full model.")
    if not (cfg.export.adapter or cfg.export.merge):
        raise ConfigError([f"export.checkpoint ({step_dir}) holds LoRA adapters only (peft=lora); add "
                           "export.adapter=true (adapter folder for peft) or export.merge=true (full merged model)."])
    output = str(cfg.export.output)
    if cfg.export.adapter:
        files, dtype = export_adapter(output=output, shards=read_model_shards(step_dir), peft=peft,
                                      source=cfg.model.pretrained, model_cfg=cfg.model, dtype=cfg.export.dtype)
        _write_template(cfg, template, out)
        out(f"export: LoRA adapters of checkpoint {step_dir} -> {output} ({dtype}, {', '.join(files)})")
        if peft.get("modules_to_save"):  # model.resize_vocab: the base takes the grown vocabulary first
            out(f"load it with: base = AutoModelForCausalLM.from_pretrained({peft.get('base_model')!r}); "
                f"base.resize_token_embeddings({cfg.model.vocab_size}); peft.PeftModel.from_pretrained(base, {output!r})")
            return 0
        out(f"load it with: peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
            f"{peft.get('base_model')!r}), {output!r})")
        return 0
    base = base_folder(peft, given_base)
    check_weights_folder(base, where=f"the base model of {step_dir} ({base})")
    files, dtype = export_merged(output=output, shards=read_model_shards(step_dir), peft=peft,
                                 source=cfg.model.pretrained, base=base, model_cfg=cfg.model, dtype=cfg.export.dtype,
                                 max_shard_bytes=parse_size(cfg.export.max_shard_size))
    _write_template(cfg, template, out)
    out(f"export: checkpoint {step_dir} merged into {base} -> {output} ({dtype}, {len(files)} files: {', '.join(files)})")
    out(f"load it with: transformers.AutoModelForCausalLM.from_pretrained({output!r})")
    return 0


def main(argv: list[str]) -> int:
    from megatron_pack.config.hf_config import UnsupportedModel
    from megatron_pack.config.schema import ConfigError
    from megatron_pack.data.formats.sources import DataError

    from megatron_pack.cli.args import parse_command_line

    line = parse_command_line("export", list(argv))
    if isinstance(line, int):
        return line
    from megatron_pack.model.cpu_compat import eager_jit_fuser_without_cuda

    eager_jit_fuser_without_cuda()  # before megatron-core's first import (reading a sharded checkpoint, LoRA)
    try:
        return run_export(line.overrides, config_dirs=line.config_dirs, print_config=line.print_config)
    except (ConfigError, DataError, UnsupportedModel, FileNotFoundError, FileExistsError, ValueError, KeyError) as exc:
        print(f"megatron-pack export: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
