"""The prepare and inspect commands end to end (in-process), with the report files."""

import json
from pathlib import Path

import pytest

from megatron_pack.cli.main import main
from megatron_pack.cli.prepare import expand_shorthands


@pytest.mark.parametrize("argv,expected", [
    (["export=bridge"], ["packing.export=bridge"]),
    (["input=a.jsonl", "packing.seed=2"], ["data.source=files", "data.input=a.jsonl", "packing.seed=2"]),
    (["data.tokenizer=byte"], ["data.tokenizer=byte"]),
    (["packing.packed_sequence_size=256"], ["packing.packed_sequence_size=256", "model.seq_length=256"]),
    (["packing.packed_sequence_size=256", "model.seq_length=512"],
     ["packing.packed_sequence_size=256", "model.seq_length=512"]),
    (["model.seq_length=1024"], ["model.seq_length=1024", "packing.packed_sequence_size=1024"]),
    (["model.seq_length=1024", "packing.mode=in_batch"], ["model.seq_length=1024", "packing.mode=in_batch"])],
    ids=["export", "input", "untouched", "pack-size-sets-seq-length", "explicit-seq-length-kept",
         "seq-length-sets-pack-size", "in-batch-has-no-pack"])
def test_shorthands(argv, expected):
    assert expand_shorthands(argv) == expected


@pytest.mark.slow
def test_prepare_then_inspect(tmp_path, capsys):
    ds_dir = tmp_path / "ds"
    rc = main(["prepare", "data=synthetic", "data.synthetic_num_samples=300", f"data.dataset_dir={ds_dir}",
               "data.tokenize_workers=1", "packing.packed_sequence_size=512", "parallel.context_parallel_size=2",
               "export=bridge"])
    out = capsys.readouterr().out
    assert rc == 0 and "efficiency" in out and "report.png" in out
    plan_dir = next((ds_dir / "plans").iterdir())
    assert plan_dir.name.startswith("pack512_mult4_bfd_seed0_error_")
    assert (plan_dir / "training_512.idx.parquet").is_file()
    assert f"bridge:  {plan_dir / 'training_512.idx.parquet'}, {plan_dir / '512_metadata.jsonl'}" in out  # says where
    (plan_dir / "report.png").unlink()  # inspect writes missing reports
    for argv in (["inspect", str(ds_dir)], ["inspect", f"data.dataset_dir={ds_dir}"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "300 samples" in out and "pack512_mult4_bfd" in out and str(plan_dir / "report.json") in out
    report = json.loads((plan_dir / "report.json").read_text())
    assert report["num_samples_packed"] == 300 and report["pack_size"] == 512
    assert sum(report["sample_length_histogram"]["counts"]) == 300
    assert sum(report["pack_fill_histogram"]["counts"]) == report["num_packs"]
    assert 0 <= report["padding_share"] < 0.5 and (plan_dir / "report.png").stat().st_size > 1000


@pytest.mark.parametrize("validation", [["data.validation_fraction=0.25"], ["data.validation=valid.jsonl"]],
                         ids=["fraction", "file"])
def test_prepare_and_inspect_account_for_the_validation_set(tmp_path, capsys, monkeypatch, validation):
    """The held-out samples are counted (read = packed + held out + dropped) and the validation plan named, by the
    prepare summary and by inspect."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps({"prompt": f"say {i}", "completion": "ok " * (1 + i % 5)})
                                                  + "\n" for i in range(12)))
    common = ["data=synthetic", "data.synthetic_num_samples=40", "data.dataset_dir=ds", "data.tokenize_workers=1",
              "packing.packed_sequence_size=256"]
    assert main(["prepare", *common, *validation]) == 0
    out = capsys.readouterr().out
    plan_dir = next(p for p in (tmp_path / "ds" / "plans").iterdir())
    if validation[0].startswith("data.validation_fraction"):
        assert "samples read 40, packed 30, held out 10," in out
        where = Path("ds/plans") / plan_dir.name / "validation"
        assert "validation: 10 samples held out (data.validation_fraction=0.25), " in out and str(where) in out
    else:
        assert f"validation: data.validation={tmp_path / 'valid.jsonl'}, " in out and " packs in ds/validation/plans/" in out
    assert main(["inspect", "ds"]) == 0
    shown = capsys.readouterr().out
    assert "held out" in shown.splitlines()[3] and f"{plan_dir.name}: validation: " in shown
    assert ("held out 10" in out) == ("10 samples held out" in shown)
    lines = shown.splitlines()  # the validation lines have their heading (a bare ":" before, issue 43 finding 8)
    assert ":" not in [line.strip() for line in lines]
    assert lines[lines.index(f"  {plan_dir.name}: validation: " + shown.split(": validation: ")[1].splitlines()[0]) - 1] \
        == "validation sets:"


def test_inspect_says_why_the_store_and_the_plan_count_tokens_differently(tmp_path, capsys):
    """The store counts ids, a plan THD positions (n - 1 for n ids): inspect gives both numbers in the store line,
    so 5,018 tokens in the store and "kept 4,898 of 4,898" in the plan no longer look like a loss (issue 43, 8)."""
    assert main(["prepare", "data=synthetic", "data.synthetic_num_samples=40", f"data.dataset_dir={tmp_path / 'ds'}",
                 "data.tokenize_workers=1", "packing.packed_sequence_size=256"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "ds")]) == 0
    shown = capsys.readouterr().out
    meta = json.loads((tmp_path / "ds" / "metadata.json").read_text())
    positions = meta["num_tokens"] - meta["num_samples"]
    assert f"{meta['num_tokens']} tokens (uint16; {positions} THD positions, the tokens the plans count: a sample " \
           "of n ids gives n - 1)" in shown
    assert f"kept {positions} of {positions} tokens" in shown  # guard: the plan's count is the store's positions


def test_cli_errors_are_one_clear_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "no metadata.json" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n')
    rc = main(["prepare", f"input={bad}", f"data.dataset_dir={tmp_path / 'ds'}", "data.tokenize_workers=1"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{bad}: line 1: missing key 'completion'" in err
    assert not (tmp_path / "ds").exists()
