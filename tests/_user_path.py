"""Helpers for the tests that drive the real command line as a user types it.

``run_cli(cwd, *argv)`` runs ``megatron-pack ARGV`` through the console script's own function
(``megatron_pack.cli.main.main``) in this process, from ``cwd``, and returns the exit status and
everything it printed. It is the same code path as the installed ``megatron-pack`` (argument
parsing, config, refusals printed as one line and exit 2); only the interpreter start-up and
imports are shared between calls, which is what lets a test run dozens of commands. The tests
that need a fresh process (torchrun, the launch scripts, the docs commands) use subprocesses.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Iterable, Optional

CUSTOM_TEMPLATE = ("{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
                   "{% if add_generation_prompt %}<s>[assistant] {% endif %}")
"""A chat template file that differs from the tiny tokenizer's own (tests/_hf.CHAT_TEMPLATE)."""


def run_cli(cwd: Path | str, *argv: str, env: Optional[dict] = None) -> tuple[int, str]:
    """``megatron-pack ARGV`` from ``cwd`` in this process: (exit status, stdout + stderr + log lines)."""
    import logging

    from megatron_pack.cli.main import main

    out = io.StringIO()
    handler = logging.StreamHandler(out)  # the commands log to the stderr they found at their first call
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    saved_env = {k: os.environ.get(k) for k in (env or {})}
    cwd_before = os.getcwd()
    try:
        os.environ.update(env or {})
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                status = main(list(argv))
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
    finally:
        root.removeHandler(handler)
        os.chdir(cwd_before)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return int(status or 0), out.getvalue()


def ok(cwd: Path | str, *argv: str, env: Optional[dict] = None) -> str:
    """``run_cli`` that must succeed: its output, or an assertion naming the command and what it printed."""
    status, text = run_cli(cwd, *argv, env=env)
    assert status == 0, f"megatron-pack {' '.join(argv)} exited {status}:\n{text[-4000:]}"
    return text


def refused(cwd: Path | str, *argv: str) -> str:
    """``run_cli`` that must be refused with exit 2 and one-line messages (no traceback)."""
    status, text = run_cli(cwd, *argv)
    assert status == 2, f"megatron-pack {' '.join(argv)} exited {status} (expected 2):\n{text[-4000:]}"
    assert "Traceback" not in text, text
    return text


def write_jsonl(path: Path, records: Iterable) -> Path:
    """One record per line; a ``str`` is written as the raw line (for malformed input)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def chat(i: int, answer_words: int = 3, *, system: bool = False) -> dict:
    """A two-turn chat record whose answer has ``answer_words`` words (lengths vary with ``i``)."""
    messages = [{"role": "system", "content": "be brief"}] if system else []
    messages += [{"role": "user", "content": f"what is {i} plus {i}"},
                 {"role": "assistant", "content": " ".join(["four"] * (1 + (i * 7 + answer_words) % answer_words))}]
    return {"messages": messages}


def plan_names(dataset_dir: Path) -> list[str]:
    return sorted(p.name for p in (Path(dataset_dir) / "plans").iterdir() if p.is_dir() and not p.name.startswith("."))


def copy_tree(dest: Path, root: Path) -> Path:
    """A fresh clone of the working tree at ``root`` (tracked and untracked-but-not-ignored files, no build outputs)."""
    import subprocess

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = Path(root) / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    return dest
