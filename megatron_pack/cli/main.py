"""`megatron-pack`: one console script, one module per subcommand.

Each subcommand module exposes ``main(argv: list[str]) -> int`` and takes Hydra-style
``key=value`` overrides. Modules are imported only when their subcommand runs, so
``megatron-pack --help`` stays fast and never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings

SUBCOMMANDS = {
    "prepare": ("megatron_pack.cli.prepare", "tokenize a raw SFT file into a token store and write a packing plan"),
    "inspect": ("megatron_pack.cli.inspect", "print a packed dataset's metadata, statistics and report"),
    "verify": ("megatron_pack.cli.verify", "run packed vs unpacked forward on a few packs and report the largest difference"),
    "train": ("megatron_pack.cli.train", "the training entry, launched by torchrun (also `python -m megatron_pack.train`)"),
    "export": ("megatron_pack.cli.export", "a checkpoint (or a pretrained folder) to a Hugging Face folder"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-pack",
        description="Packed-sequence SFT in the THD layout with context parallelism, on megatron-core. "
        "Every subcommand takes Hydra-style key=value overrides (see docs/configuration.md); "
        "`megatron-pack <command> --help` lists its presets and common keys.",
        epilog="--version prints the versions of megatron-pack, megatron-core, torch and python.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def warn_once_on_rank_0(rank: str | int | None = None) -> None:
    """Print each warning once per run, from rank 0 (``$RANK``, 0 outside torchrun).

    megatron-core warns that Transformer Engine / Apex are absent from several modules, and every rank
    warns what rank 0 warns: 4 identical lines on 2 ranks. Rank 0 now prints each distinct message once
    (whatever module raised it), as one line ``Category: message (library/file.py)`` without the source
    line, and the Transformer Engine / Apex fallback family as one line (``FALLBACK_LINE``); the other
    ranks print none. Warning filters (``-W``, ``PYTHONWARNINGS``) still decide what is shown at all.
    """
    rank = os.environ.get("RANK", "0") if rank is None else rank
    if str(rank) != "0":
        warnings.simplefilter("ignore")
        return
    seen: set[tuple[str, str]] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        key = ("fallback", "") if _FALLBACK.search(text) else (category.__name__, text)
        if key in seen:
            return
        seen.add(key)
        text = FALLBACK_LINE if key[0] == "fallback" else text.strip().replace("\n", " ")
        (file or sys.stderr).write(f"{category.__name__}: {text} ({_library_of(filename)})\n")

    warnings.showwarning = show


_FALLBACK = re.compile(r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed")
FALLBACK_LINE = ("Transformer Engine / Apex are not installed: megatron-core uses its local and torch fallbacks "
                 "(expected on a CPU host; megatron_pack[gpu] installs them)")
"""megatron-core's several "X is not installed. Falling back to ..." warnings, said once as this one line."""


def _library_of(filename: str) -> str:
    """``megatron/core/optimizer/__init__.py`` for a file under site-packages (the warning's source, short)."""
    parts = filename.replace("\\", "/").split("/site-packages/")
    return parts[-1]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    warn_once_on_rank_0()
    if argv[:1] == ["--version"]:
        from megatron_pack.cli.args import version_text

        print(version_text())
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser = _parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"megatron-pack: unknown subcommand {argv[0]!r}; choose one of {list(SUBCOMMANDS)}.",
                  file=sys.stderr)
            return 2
        parser.print_help()
        return 0 if argv else 2
    module_name, _ = SUBCOMMANDS[argv[0]]
    if any(a in ("-h", "--help", "--version") for a in argv[1:]):  # answered before the module (and torch) loads
        from megatron_pack.cli.args import parse_command_line

        own_flags = {"train": ("--check",)}.get(argv[0], ())  # options the subcommand strips itself
        answered = parse_command_line(argv[0], [a for a in argv[1:] if a not in own_flags])
        if isinstance(answered, int):
            return answered
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"megatron-pack {argv[0]}: not implemented yet (see README.md, 'Coming').", file=sys.stderr)
        return 3
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
