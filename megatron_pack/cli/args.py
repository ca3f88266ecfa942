"""The options every subcommand shares, around its ``key=value`` overrides; and its ``--help``.

    megatron-pack <command> [--config-dir DIR]... [--cfg job] [key=value ...]
    megatron-pack <command> --help | --version

``--help`` lists the groups and their presets (shipped and the user's), the keys this command
is mostly run with (default and meaning) and points to docs/configuration.md. ``--cfg job``
prints the resolved config (as the command would run it) and exits, as Hydra's does. Nothing
here imports torch, so help and version answer at once.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from megatron_pack.config.foreign_names import flag_override, foreign_name

COMMON_KEYS = {
    "prepare": ["data.input", "data.tokenizer", "data.dataset_dir", "data.schema", "packing.packed_sequence_size",
                "packing.on_overflow", "packing.algorithm", "parallel.context_parallel_size", "packing.export"],
    "inspect": ["data.dataset_dir"],
    "export": ["export.checkpoint", "export.output", "model.pretrained", "export.dtype", "export.max_shard_size",
               "export.adapter", "export.merge"],
    "verify": ["data.dataset_dir", "data.plan", "verify.num_packs", "verify.checkpoint", "verify.tolerance",
               "verify.attention"],
    "train": ["data.dataset_dir", "data.plan", "model.pretrained", "peft.method", "train.train_iters", "train.lr",
              "train.global_batch_size", "train.micro_batch_size", "parallel.context_parallel_size",
              "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
              "parallel.expert_model_parallel_size", "train.output_dir", "checkpoint.load", "packing.mode"],
}
USAGE_EXTRA = {
    "prepare": ("Shorthands: input=PATH (data=files data.input=PATH), tokenizer=X, output=DIR (data.dataset_dir), "
                "export=bridge. A pack size without model.seq_length sets it too."),
    "inspect": "Also: megatron-pack inspect DIR; megatron-pack inspect DIR sample=I (sample I decoded, the tokens that "
               "carry loss marked [[...]]).",
    "verify": ("Reads the tokenizer, pack size, pad multiple and vocab size prepare recorded in data.dataset_dir; "
               "a folder with several plans needs data.plan=<name> (inspect lists them)."),
    "train": ("Launch with torchrun (launch/single_node.sh N ...). Reads what prepare recorded in data.dataset_dir "
              "(tokenizer, pack size = model.seq_length, pad multiple, vocab size) unless set here."),
    "export": ("Shorthands: checkpoint=PATH (export.checkpoint), output=DIR (export.output). Runs in one process "
               "whatever layout wrote the checkpoint."),
}


@dataclass
class CommandLine:
    """A subcommand's argv, split: the overrides and the shared options."""

    overrides: list[str] = field(default_factory=list)
    config_dirs: list[str] = field(default_factory=list)
    print_config: bool = False


def version_text() -> str:
    """``megatron-pack 0.1.0 (megatron-core 0.16.1, torch 2.13.0, python 3.11.x)``, read without importing them."""
    import platform
    from importlib import metadata  # here: its import (email, zipfile, csv) is 10-20 ms of every command's start

    from megatron_pack import __version__

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"megatron-pack {__version__} (megatron-core {installed('megatron-core')}, torch {installed('torch')}, "
            f"python {platform.python_version()})")


def parse_command_line(command: str, argv: list[str]) -> Union[CommandLine, int]:
    """The overrides and options of ``argv``; or an exit code once help, version or a bad option is printed."""
    line, i = CommandLine(), 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if arg in ("-h", "--help"):
            print(help_text(command, line.config_dirs))
            return 0
        if arg == "--version":
            print(version_text())
            return 0
        if name in ("--cfg", "-c", "--config-dir", "-cd"):
            if not eq:
                if i + 1 >= len(argv):
                    return _bad_option(command, f"{arg} needs a value")
                value, i = argv[i + 1], i + 1
            if name in ("--cfg", "-c"):
                if value not in ("job", "all"):
                    return _bad_option(command, f"{name} {value}: only 'job' is printed (the resolved config)")
                line.print_config = True
            else:
                line.config_dirs.append(value)
        elif arg.startswith("--") and flag_override(argv, i):
            return _foreign_flag(command, argv, i)
        elif arg.startswith("-") and "=" not in arg:
            return _bad_option(command, f"unknown option {arg}")
        else:
            line.overrides.append(arg)
        i += 1
    return line


def _foreign_flag(command: str, argv: list[str], i: int) -> int:
    """A Megatron-LM flag (``--tensor-model-parallel-size 2``): the override it means, in one line."""
    entry = foreign_name(argv[i])
    how = f" ({entry.name} {entry.differs})" if entry.differs else ""
    print(f"megatron-pack {command}: {argv[i].split('=', 1)[0]} is a Megatron-LM flag; write "
          f"{flag_override(argv, i)} instead (key=value overrides){how}.", file=sys.stderr)
    return 2


def _bad_option(command: str, problem: str) -> int:
    print(f"megatron-pack {command}: {problem}; options are --help, --version, --cfg job, --config-dir DIR, "
          "then key=value overrides.", file=sys.stderr)
    return 2


def field_docs() -> dict[str, str]:
    """``{"train.lr": "Peak learning rate.", ...}``: the docstring under each schema field."""
    from megatron_pack.config import schema

    docs, tree = {}, ast.parse(inspect.getsource(schema))
    group_of = {cls.__name__: group for group, cls in schema.GROUPS.items()}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in group_of):
        body = cls.body
        for stmt, nxt in zip(body, body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[f"{group_of[cls.name]}.{stmt.target.id}"] = " ".join(str(nxt.value.value).split())
    return docs


def _default(key: str) -> str:
    from megatron_pack.config.schema import GROUPS

    group, name = key.split(".")
    declared = next(f for f in dataclasses.fields(GROUPS[group]) if f.name == name)
    value = declared.default if declared.default is not dataclasses.MISSING else getattr(GROUPS[group](), name)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def help_text(command: str, config_dirs: Optional[list[str]] = None) -> str:
    """What ``megatron-pack <command> --help`` prints."""
    from megatron_pack.config.schema import GROUPS, ConfigError
    from megatron_pack.config.search_path import PRESETS_DIR, presets, user_config_dirs

    try:
        roots = [PRESETS_DIR, *user_config_dirs(config_dirs or [])]
    except ConfigError as exc:
        roots = [PRESETS_DIR]
        print(f"megatron-pack {command}: {exc.problems[0]}", file=sys.stderr)
    options, docs = presets(roots), field_docs()
    lines = [f"usage: megatron-pack {command} [--config-dir DIR] [--cfg job] [key=value ...]",
             f"       megatron-pack {command} --help | --version", "",
             _summary(f"megatron_pack.cli.{command}"), USAGE_EXTRA.get(command, ""), "",
             "options:",
             "  -h, --help          this help",
             "  --version           megatron-pack, megatron-core, torch and python versions",
             "  --cfg job           print the resolved config and exit (nothing is run)",
             "  --config-dir DIR    also search DIR/<group>/<name>.yaml for presets (repeatable; "
             "MEGATRON_PACK_CONFIG_DIR too)", "",
             "presets (select with group=name; experiment=path/to/run.yaml reads a file):"]
    lines += [f"  {group:<11} {', '.join(names)}" for group, names in options.items()]
    lines += ["", f"groups (set keys as group.key=value): {', '.join(GROUPS)}", "", "common keys (default):"]
    for key in COMMON_KEYS.get(command, []):
        if key.split(".")[0] in GROUPS and key in docs:
            lines.append(f"  {key}={_default(key)}")
            lines.append(f"      {docs[key]}")
    lines += ["", "Every key, preset and validation rule: docs/configuration.md "
              "(`megatron-pack " + command + " --cfg job` shows the values a run would use)."]
    return "\n".join(lines)


def _summary(module_name: str) -> str:
    """The first paragraph of a subcommand module's docstring (it starts with the command line),
    read from the source without importing the module (``verify`` and ``export`` import torch)."""
    import importlib.util

    spec = importlib.util.find_spec(module_name)
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) if spec and spec.origin else ""
    return " ".join((doc or "").strip().split("\n\n", 1)[0].split())


def print_resolved(cfg, note: Optional[str] = None) -> int:
    """``--cfg job``: the resolved config as YAML on stdout (a note, if any, on stderr); exit code 0."""
    from megatron_pack.config.loader import config_to_yaml

    print(config_to_yaml(cfg), end="")
    if note:
        print(note, file=sys.stderr)
    return 0
