"""A damaged JSON file of a prepared dataset is one ``is damaged`` line and exit 2 in every command that reads it.

Each case damages one JSON file of a copy of one prepared dataset (the store's or a plan's ``metadata.json``,
cut short, not UTF-8, or not an object), then runs ``megatron-pack inspect / train / verify / export`` in-process
through the console script's ``main``. Each must exit 2 with one line ``megatron-pack <command>: <file> is damaged
(...)`` naming the file and the fix, and no traceback (issue 43, finding 2: it was a raw JSONDecodeError).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

BASE = ["experiment=quickstart", "data.synthetic_num_samples=40", "data.tokenize_workers=1",
        "packing.packed_sequence_size=256", "model.seq_length=256"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A dataset, its one plan, and a folder holding only a Hugging Face ``config.json`` (export's model)."""
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare import prepare

    root = tmp_path_factory.mktemp("store_json")
    plan = prepare(load_config(BASE + [f"data.dataset_dir={root / 'ds'}"]), progress=False)
    model = root / "model"
    model.mkdir()
    from _hf import hf_config

    hf_config("llama_tied").save_pretrained(model)
    return root / "ds", plan, model


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _not_utf8(path: Path) -> None:
    path.write_bytes(b"\xff\xfe" + path.read_bytes())


def _a_list(path: Path) -> None:
    path.write_text(json.dumps([json.loads(path.read_text())]))


# id, which file (store / plan), damage, what the line says about it
DAMAGES = [
    ("store-cut-short", "store", _cut, "not valid JSON"),
    ("store-not-utf8", "store", _not_utf8, "not UTF-8 text"),
    ("plan-cut-short", "plan", _cut, "not valid JSON"),
    ("plan-a-list", "plan", _a_list, "a JSON list, not an object"),
]
COMMANDS = ["inspect", "train", "verify", "export"]


def _argv(command: str, ds: Path, plan: Path, model: Path, tmp_path: Path) -> list[str]:
    if command == "inspect":
        return ["inspect", str(ds)]
    if command == "export":
        return ["export", f"model.pretrained={model}", f"output={tmp_path / 'out'}", f"data.dataset_dir={ds}"]
    return [command, *BASE, f"data.dataset_dir={ds}", f"train.output_dir={tmp_path / 'run'}"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("which,damage,why", [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES])
def test_damaged_json_is_one_line(prepared, tmp_path, monkeypatch, capsys, command, which, damage, why):
    from megatron_pack.cli.main import main

    good, plan, model = prepared
    ds = tmp_path / "ds"
    shutil.copytree(good, ds)
    damaged = (ds if which == "store" else ds / "plans" / plan.name) / "metadata.json"
    damage(damaged)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    assert main(_argv(command, ds, plan, model, tmp_path)) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"megatron-pack {command}: "), err
    assert f"{damaged} is damaged ({why}" in err and "re-run `megatron-pack prepare`" in err, err
    assert "Traceback" not in captured.out + captured.err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["inspect", "{ds}"], ["train", "--check", *BASE, "data.dataset_dir={ds}"]],
                         ids=["inspect", "train-check"])
def test_the_undamaged_copy_is_accepted(prepared, tmp_path, monkeypatch, capsys, argv):
    """Guard: the refusals above come from the damage (the same commands pass on an undamaged copy; each refusal
    names the damaged file itself, so it cannot come from elsewhere)."""
    from megatron_pack.cli.main import main

    good, _, _ = prepared
    shutil.copytree(good, tmp_path / "ds")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main([a.format(ds=tmp_path / "ds") for a in argv] + [f"train.output_dir={tmp_path / 'run'}"]
                * (argv[0] == "train")) == 0, capsys.readouterr().err
