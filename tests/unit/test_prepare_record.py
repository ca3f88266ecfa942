"""The no-op ``prepare``: proved from hashed inputs, answered without building a tokenizer.

Through ``megatron-pack prepare`` (in-process) on a small JSONL: the second identical run never
builds a tokenizer (``build_tokenizer`` is made to fail) and prints the same summary; a changed
input file, config key, tokenizer file or output, each runs the full ``prepare`` again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron_pack.cli.prepare import main as prepare_main

ARGS = ["input=t.jsonl", "tokenizer=byte", "output=ds", "packing.packed_sequence_size=128", "data.tokenize_workers=1"]


def _write_input(root: Path, n: int = 30) -> None:
    (root / "t.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n"
                                          for i in range(n)))


@pytest.fixture()
def prepared(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write_input(tmp_path)
    assert prepare_main(ARGS) == 0
    return tmp_path, capsys.readouterr().out


def _built_tokenizer(monkeypatch) -> list:
    import megatron_pack.data.formats.tokenizer as tokenizer

    calls: list = []
    real = tokenizer.build_tokenizer
    monkeypatch.setattr(tokenizer, "build_tokenizer", lambda *a, **k: calls.append(a) or real(*a, **k))
    import megatron_pack.data.prepare as prepare

    monkeypatch.setattr(prepare, "build_tokenizer", tokenizer.build_tokenizer)
    return calls


def test_second_identical_run_builds_no_tokenizer(prepared, monkeypatch, capsys, caplog):
    root, first = prepared
    caplog.set_level(logging.INFO)
    calls = _built_tokenizer(monkeypatch)
    assert prepare_main(ARGS) == 0
    out = capsys.readouterr().out
    assert calls == [] and "nothing changed since the prepare that wrote" in caplog.text
    assert out == first  # the same summary
    assert len(list((root / "ds" / ".prepare_records").glob("*.json"))) == 1


CHANGES = [  # (id, what changes before the second run)
    # a changed input replaces the store, which takes data.overwrite=true (issue 34: never replaced silently)
    ("input-file", lambda root, args: _write_input(root, 31) or args + ["data.overwrite=true"]),
    ("config-key", lambda root, args: args + ["packing.seed=1"]),
    ("output-removed", lambda root, args: next((root / "ds" / "plans").glob("*/report.png")).unlink() or args),
]


@pytest.mark.parametrize("change", [c[1] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_any_change_runs_the_full_prepare(prepared, monkeypatch, caplog, change):
    root, _ = prepared
    caplog.set_level(logging.INFO)
    args = change(root, list(ARGS))
    calls = _built_tokenizer(monkeypatch)
    assert prepare_main(args) == 0
    assert calls and "nothing changed" not in caplog.text
    assert next((root / "ds" / "plans").glob("*/report.png")).is_file()


def test_tokenizer_files_are_hashed_weights_are_not(tmp_path):
    from megatron_pack.config import load_config
    from megatron_pack.data.prepare_record import _tokenizer_files, inputs_key

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    cfg = load_config(["data=files", f"data.input={tmp_path / 'x.jsonl'}", f"data.tokenizer={folder}"])
    assert [f.name for f in _tokenizer_files(cfg)] == ["tokenizer.json"]
    (tmp_path / "x.jsonl").write_text("{}\n")
    before = inputs_key(cfg)
    (folder / "model.safetensors").write_bytes(b"other weights")
    assert inputs_key(cfg) == before
    (folder / "tokenizer.json").write_text('{"changed": 1}')
    assert inputs_key(cfg) != before


def _sources(weight_a: float) -> str:
    return (f"data.sources=[{{name: a, input: a.jsonl, weight: {weight_a}}}, "
            f"{{name: b, input: b.jsonl, weight: {round(1 - weight_a, 2)}}}]")


def test_what_issue_21_records_is_in_the_record(tmp_path, monkeypatch, caplog):
    """The settings a plan's manifest records since issue 21 (data.sources, data.on_bad_record, a source file's
    contents): the same command is a no-op, each change runs the full prepare."""
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{name}{i}", "completion": "x"}) + "\n"
                                                        for i in range(20)) + "{bad\n")
    args = ["data.source=files", "tokenizer=byte", "output=ds", "packing.packed_sequence_size=128",
            "data.tokenize_workers=1", "data.on_bad_record=skip"]
    assert prepare_main(args + [_sources(0.5)]) == 0
    caplog.set_level(logging.INFO)
    calls = _built_tokenizer(monkeypatch)
    assert prepare_main(args + [_sources(0.5)]) == 0 and calls == [] and "nothing changed" in caplog.text
    runs = [(args + [_sources(0.7)], 0),  # a source's weight
            ([*args[:-1], "data.on_bad_record=error", _sources(0.5)], 2)]  # the policy (error: the bad line stops it)
    for changed, expected in runs:
        caplog.clear()
        assert prepare_main(changed) == expected
        assert calls and "nothing changed" not in caplog.text, changed
        calls.clear()
    (tmp_path / "b.jsonl").write_text((tmp_path / "b.jsonl").read_text() + json.dumps({"prompt": "new", "completion": "y"}) + "\n")
    caplog.clear()
    assert prepare_main(args + [_sources(0.7)]) == 2  # a source file's contents changed: the store is not replaced
    assert prepare_main(args + [_sources(0.7), "data.overwrite=true"]) == 0 and calls and "nothing changed" not in caplog.text


def test_a_no_op_prepare_warns_of_lost_data_again(tmp_path, monkeypatch, caplog):
    """The >5% lost answer targets warning is said by the no-op run too (read from the metadata, no arrays)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"prompt": "q" * 20, "completion": "a" * 30}) + "\n"
                                              for _ in range(10)))
    args = ["input=t.jsonl", "tokenizer=byte", "output=ds", "packing.packed_sequence_size=32",
            "packing.on_overflow=truncate", "data.tokenize_workers=1"]
    caplog.set_level(logging.INFO)
    assert prepare_main(args) == 0
    first = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "answer targets" in r.getMessage()]
    caplog.clear()
    calls = _built_tokenizer(monkeypatch)
    assert prepare_main(args) == 0 and calls == [] and "nothing changed" in caplog.text
    again = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "answer targets" in r.getMessage()]
    assert len(first) == 1 and again == first and "packing.on_overflow=split" in first[0]
