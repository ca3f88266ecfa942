"""Every subcommand's --help, --cfg job and --version (issue 11 item 1)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from megatron_pack.cli.args import COMMON_KEYS, parse_command_line
from megatron_pack.cli.main import main

COMMANDS = ["prepare", "inspect", "verify", "train", "export"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_groups_presets_keys_and_the_docs(command, flag, capsys):
    assert main([command, flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: megatron-pack {command}")
    from megatron_pack.config.loader import config_dir
    from megatron_pack.config.search_path import presets

    shipped = [f"  {group:<11} {', '.join(names)}" for group, names in presets(config_dir()).items()]
    assert len(shipped) >= 4 and "quickstart" in shipped[1]  # data, experiment, model, parallel
    for part in ("docs/configuration.md", "--cfg job", "--config-dir", *shipped,
                 "model, data, packing, parallel, train"):
        assert part in out, part
    shown = [key for key in COMMON_KEYS[command] if f"  {key}=" in out]
    assert len(shown) == len(COMMON_KEYS[command]) and shown  # every common key, with its default and meaning


def test_train_check_with_help_prints_the_help(capsys):
    """``--check`` is train's own flag: ``train --check --help`` is help, not an unknown option."""
    assert main(["train", "--check", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: megatron-pack train")


def test_help_lists_the_users_presets(tmp_path, capsys):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "my_run.yaml").write_text("# @package _global_\n")
    assert main(["train", "--config-dir", str(tmp_path), "--help"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("  experiment "))
    assert "my_run" in line.split() or "my_run," in line.split() and "quickstart" in line


def test_help_and_version_do_not_import_torch():
    code = ("import sys; from megatron_pack.cli.main import main; "
            "assert all(main([c, '--help']) == 0 for c in ('train', 'prepare', 'inspect', 'export', 'verify')) and main(['--version']) == 0; "
            "assert 'torch' not in sys.modules, 'help imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


def test_train_check_does_not_import_torch(tmp_path):
    """What the launch scripts run before torchrun stays fast (docs/benchmarks.md, start-up): on a prepared dataset,
    with a fixed step count, `train --check` opens the plan and its validation without torch."""
    from megatron_pack.cli.main import main as cli

    data = [f"data.dataset_dir={tmp_path / 'ds'}", "data.synthetic_num_samples=60", "packing.packed_sequence_size=128",
            "model.seq_length=128", "data.validation_fraction=0.2"]
    assert cli(["prepare", *data]) == 0
    code = ("import sys; from megatron_pack.cli.main import main; "
            f"assert main(['train', '--check', 'model=tiny', 'train.train_iters=2', *{data!r}]) == 0; "
            "assert 'torch' not in sys.modules, 'train --check imported torch'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "WORLD_SIZE": "1"})
    assert out.returncode == 0 and "config ok for 1 rank(s)" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("argv", [["--version"], ["train", "--version"], ["prepare", "--version"]])
def test_version(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("megatron-pack 0.1.0 (megatron-core ") and "torch 2.13" in out


CFG_JOB = [  # (id, argv, key path, expected value) -- the resolved config, nothing run
    ("prepare-shorthand", ["prepare", "--cfg", "job", "input=a.jsonl", "packing.packed_sequence_size=256"],
     ("model", "seq_length"), 256),
    ("prepare-equals", ["prepare", "--cfg=job", "output=/tmp/x"], ("data", "dataset_dir"), "/tmp/x"),
    ("inspect", ["inspect", "--cfg", "job", "data.dataset_dir=D"], ("data", "dataset_dir"), "D"),
    ("min-lr-derived", ["prepare", "--cfg", "job", "train.lr=2e-5"], ("train", "min_lr"), pytest.approx(2e-6)),
]


@pytest.mark.parametrize("argv,path,value", [c[1:] for c in CFG_JOB], ids=[c[0] for c in CFG_JOB])
def test_cfg_job_prints_the_resolved_config(argv, path, value, tmp_path, capsys):
    assert main(argv) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    from megatron_pack.config.schema import GROUPS

    assert set(resolved) == set(GROUPS) and len(GROUPS) >= 9
    assert resolved[path[0]][path[1]] == value
    assert not (tmp_path / "x").exists()


def test_cfg_job_for_train_and_verify_shows_what_the_dataset_sets(tmp_path, capsys):
    ds = tmp_path / "ds"
    assert main(["prepare", "data=synthetic", "data.synthetic_num_samples=60", "data.tokenize_workers=1",
                 f"data.dataset_dir={ds}", "packing.packed_sequence_size=256", "parallel.context_parallel_size=2"]) == 0
    capsys.readouterr()
    for command in ("train", "verify"):
        assert main([command, "--cfg", "job", f"data.dataset_dir={ds}", "parallel=cp2"]) == 0
        captured = capsys.readouterr()
        resolved = yaml.safe_load(captured.out)
        assert resolved["model"]["seq_length"] == 256 and resolved["packing"]["pad_seq_to_mult"] == 4
        assert "model.seq_length=256 (was 512)" in captured.err
    assert not (tmp_path / "runs").exists()


BAD = [
    ("unknown-option", ["train", "--bogus"], "unknown option --bogus"),
    ("cfg-hydra", ["train", "--cfg", "hydra"], "only 'job' is printed"),
    ("cfg-no-value", ["verify", "--cfg"], "--cfg needs a value"),
    ("missing-config-dir", ["prepare", "--config-dir", "/nonexistent/x"], "--config-dir /nonexistent/x: no such folder"),
]


@pytest.mark.parametrize("argv,message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_options_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_parse_keeps_overrides_in_order():
    line = parse_command_line("train", ["a.b=1", "--config-dir", "X", "--cfg", "job", "c=2", "--config-dir=Y"])
    assert line.overrides == ["a.b=1", "c=2"] and line.config_dirs == ["X", "Y"] and line.print_config
