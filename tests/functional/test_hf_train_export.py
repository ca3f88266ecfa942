"""Fine-tune a pretrained HF folder end to end and hand the result back to transformers.

`experiment=pretrained_tiny` as written (a tiny random Llama with llama3 rope scaling in
models/tiny-llama, its own tokenizer, synthetic SFT data): prepare, train 3 steps at CP=2 under
torchrun (2 CPU ranks), `megatron-pack export checkpoint=...`, then
`transformers.AutoModelForCausalLM.from_pretrained(export)`:

1. the export loads with no missing or unexpected keys and has the source's files;
2. its logits equal ours from the same checkpoint (<= 1e-4), computed by our model (TP=1);
3. its weights differ from the source (training happened) and keep the source dtype;
4. ``export.dtype=bfloat16`` writes bfloat16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _hf import cli, make_family, packed_logits, prepare_in, torchrun_train

RUN = ["experiment=pretrained_tiny", "data.synthetic_num_samples=24", "logging.log_interval=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_train")
    make_family(root / "models", "llama_rope", name="tiny-llama")
    prepare_in(root, RUN)
    (root / "train.log").write_text(torchrun_train(root, RUN))  # its last lines name the next step
    return root


def _export(root: Path, *args: str) -> tuple[int, str]:
    return cli(root, "export", *args)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_from_pretrained_export_and_load_with_transformers(trained):
    import transformers as T

    root = trained
    metrics = [json.loads(line) for line in (root / "runs/pretrained_tiny/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "step" in m][-1] == 3
    assert (root / "runs/pretrained_tiny/checkpoints/hf_source/config.json").is_file()

    rc, out = _export(root, "checkpoint=runs/pretrained_tiny/checkpoints", "output=exports/tiny",
                      "export.max_shard_size=100KB")
    assert rc == 0, out
    export = root / "exports/tiny"
    names = {p.name for p in export.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= names
    assert sum(n.endswith(".safetensors") for n in names) > 1  # size-capped shards

    model, info = T.AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    source, exported = _tensors(root / "models/tiny-llama"), _tensors(export)
    assert sorted(source) == sorted(exported)
    assert all(exported[k].dtype == source[k].dtype for k in source)
    changed = [k for k in source if not torch.equal(source[k], exported[k])]
    assert len(changed) == len(source), sorted(set(source) - set(changed))  # every tensor was trained

    samples = [[5, 17, 99, 200, 3, 44, 2], list(range(3, 40)) + [2]]
    ours = packed_logits(root, RUN, root / "runs/pretrained_tiny/checkpoints", samples)
    model.eval()
    with torch.no_grad():
        theirs = [model(torch.tensor([s[:-1]])).logits[0] for s in samples]
    assert sum(t.shape[0] for t in theirs) == sum(len(s) - 1 for s in samples)
    assert max(float((o - t).abs().max()) for o, t in zip(ours, theirs)) <= 1e-4

    rc, out = _export(root, "checkpoint=runs/pretrained_tiny/checkpoints", "output=exports/tiny_bf16",
                      "export.dtype=bfloat16")
    assert rc == 0, out
    assert {t.dtype for t in _tensors(root / "exports/tiny_bf16").values()} == {torch.bfloat16}
    config = json.loads((root / "exports/tiny_bf16/config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"  # transformers 5 / 4 spelling

    rc, out = _export(root, "checkpoint=runs/pretrained_tiny/checkpoints", "output=exports/tiny")
    assert rc == 2 and "exists and is not empty" in out and "Traceback" not in out


PACK_LINE = r"^pack \d+: (\d+) samples, .* max \|logit diff\| (\S+)  max \|loss diff\| (\S+)  (PASS|FAIL)$"
VERIFY = RUN + ["verify.reference=transformers", "verify.num_packs=2"]


def _verify_lines(text: str) -> list[tuple[int, float, str]]:
    import re

    return [(int(m[1]), float(m[2]), m[4]) for m in map(lambda l: re.match(PACK_LINE, l), text.splitlines()) if m]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verify_against_transformers_in_one_process(trained, capsys, monkeypatch):
    from megatron_pack.cli.verify import main as verify_main

    monkeypatch.chdir(trained)
    assert verify_main(VERIFY) == 0
    lines = _verify_lines(capsys.readouterr().out)
    assert len(lines) == 2 and sum(n for n, _, _ in lines) > 2  # packs of several samples compared
    assert all(verdict == "PASS" and diff <= 1e-4 for _, diff, verdict in lines)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verify_against_transformers_catches_a_wrong_mapping(trained, capsys, monkeypatch):
    """[up; gate] instead of [gate; up] in linear_fc1: the kind of slip verify exists to catch."""
    from megatron_pack.cli.verify import main as verify_main
    from megatron_pack.model.hf.transforms import GatedMLP

    original = GatedMLP.load

    def swapped(self, names, reader, dims, rank):
        return original(self, names[::-1], reader, dims, rank)

    monkeypatch.setattr(GatedMLP, "load", swapped)  # load_shard_into fills linear_fc1 through it
    monkeypatch.chdir(trained)
    assert verify_main(VERIFY) == 1
    out = capsys.readouterr().out
    assert all(verdict == "FAIL" and diff > 1e-3 for _, diff, verdict in _verify_lines(out))
    assert out.rstrip().endswith(": FAIL")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verify_against_transformers_at_pp2_tp2_under_torchrun(trained):
    """The user's command at the layout PP=2 x TP=2 (4 ranks, pipeline stages of one layer each): one line per
    pack from the last stage, PASS, exit 0 on every rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    layout = ["parallel.pipeline_model_parallel_size=2", "parallel.tensor_model_parallel_size=2",
              "parallel.context_parallel_size=1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "megatron_pack.cli.main", "verify", *VERIFY, *layout]
    proc = subprocess.run(cmd, cwd=trained, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("at PP=2 TP=2 CP=1 EP=1 DP=1 ") == 1  # one rank (the last stage's first) prints
    lines = _verify_lines(proc.stdout)
    assert len(lines) == 2 and all(verdict == "PASS" and diff <= 1e-4 for _, diff, verdict in lines)


def next_step_commands(log: str) -> list[list[str]]:
    """The commands a finished run's last lines name (``next: ...`` and ``  or: ...``), comments left out."""
    import shlex

    lines = [line.strip() for line in log.splitlines() if line.strip().startswith(("next: megatron-pack", "or: megatron-pack"))]
    return [shlex.split(line.split(": ", 1)[1], comments=True) for line in lines]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_run_ends_naming_the_export_of_its_checkpoint(trained):
    """The end of training names the next step (issue 43, item 9); run as printed, it exports this run."""
    root = trained
    commands = next_step_commands((root / "train.log").read_text())
    assert commands == [["megatron-pack", "export", "checkpoint=runs/pretrained_tiny/checkpoints",
                         "output=exports/pretrained_tiny"]], commands
    rc, out = cli(root, *commands[0][1:])
    assert rc == 0 and (root / "exports/pretrained_tiny/config.json").is_file(), out
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (root / "exports/pretrained_tiny").iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # model.safetensors was 0600 (issue 43, finding 8)
