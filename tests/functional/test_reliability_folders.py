"""Bad model and tokenizer folders are refused before anything starts, in one line, by every command.

A tiny random Llama (tests/_hf.py) and the ``pretrained_tiny`` dataset prepared from it, then one
damaged copy per case. Each case goes through ``launch/single_node.sh 2`` (its ``train --check``:
exit 2, one ``megatron-pack train:`` line naming the file, no traceback, torchrun never started,
no run folder) and through ``prepare``, ``verify`` and ``export`` (the same line from each, exit 2,
nothing written). ``prepare`` reads no weight, so it accepts the NaN folder (its headers are fine);
``export`` does not load a tokenizer.

Before this check each of these ended inside torchrun (about 250 lines, three tracebacks and
``ChildFailedError``), or in a transformers traceback.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from _hf import make_family, prepare_in
from _launch import REPO, launch_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
RUN = ["experiment=pretrained_tiny", "data.synthetic_num_samples=24"]
SHARD = "model-00003-of-00007.safetensors"


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8:8 + length])


def _poison(path: Path, name: str) -> None:
    """One NaN and one Inf in tensor ``name`` of the safetensors file ``path`` (float32)."""
    length, header = _header(path)
    begin = 8 + length + header[name]["data_offsets"][0]
    with open(path, "r+b") as f:
        for index, value in ((5, np.nan), (7, np.inf)):
            f.seek(begin + 4 * index)
            f.write(np.float32(value).tobytes())


def _index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def missing_shard(folder: Path) -> str:
    (folder / SHARD).unlink()
    return f"model.safetensors.index.json names {SHARD}, which is not in the folder"


def missing_tensor(folder: Path) -> str:
    index = _index(folder)
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return "has no tensor model.layers.1.mlp.down_proj.weight, which the llama mapping needs"


def pickle_only(folder: Path) -> str:
    for file in [*folder.glob("*.safetensors"), folder / "model.safetensors.index.json"]:
        file.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"a pickle: never opened")
    return "It holds pytorch_model.bin (a pickle, never loaded here): convert it once with transformers"


def truncated(folder: Path) -> str:
    size = (folder / SHARD).stat().st_size
    with open(folder / SHARD, "r+b") as f:
        f.truncate(size - 100)
    return f"{SHARD} is truncated: its header describes"


def broken_header(folder: Path) -> str:
    with open(folder / SHARD, "r+b") as f:
        f.seek(12)
        f.write(b"\xff" * 16)
    return f"{SHARD} has a broken safetensors header (not valid JSON"


def nan_weights(folder: Path) -> str:
    name = "model.layers.0.mlp.down_proj.weight"
    _poison(folder / _index(folder)["weight_map"][name], name)
    return f"holds {name} with 1 NaN and 1 Inf values; the weights are damaged (not the data)"


def no_tokenizer_files(folder: Path) -> str:
    for file in ("tokenizer.json", "chat_template.jinja"):
        (folder / file).unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    return "tokenizer_config.json names LlamaTokenizer, which reads tokenizer.json or tokenizer.model; the folder has none"


HUB = "no network access to model hubs here; download it and pass the local folder"
# (id, damage (None: the key names a Hub id), the key it is passed as, commands that refuse it)
CASES = [
    ("missing-shard", missing_shard, "model.pretrained", ("launch", "prepare", "verify", "export")),
    ("missing-tensor", missing_tensor, "model.pretrained", ("launch", "prepare", "verify", "export")),
    ("pickle-only", pickle_only, "model.pretrained", ("launch", "prepare", "verify", "export")),
    ("truncated", truncated, "model.pretrained", ("launch", "prepare", "verify", "export")),
    ("broken-header", broken_header, "model.pretrained", ("launch", "prepare", "verify", "export")),
    ("nan-weights", nan_weights, "model.pretrained", ("launch", "verify", "export")),
    ("hub-id", None, "model.pretrained", ("launch", "prepare", "verify", "export")),
    ("no-tokenizer-files", no_tokenizer_files, "data.tokenizer", ("launch", "prepare", "verify")),
    ("tokenizer-hub-id", None, "data.tokenizer", ("launch", "prepare", "verify")),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("preflight")
    make_family(root / "models", "llama_rope", name="tiny-llama")
    prepare_in(root, RUN)
    return root


def _one_line(log: str, command: str, fragment: str) -> None:
    """Printed once, the problem on one line: ``megatron-pack train: <problem>``, or for a config key
    (model.pretrained naming no folder) the config refusal's ``1 config problem(s):`` and its one item."""
    lines = log.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith(f"megatron-pack {command}:")]
    assert len(heads) == 1, log[-3000:]
    head = lines[heads[0]]
    if head.endswith("1 config problem(s):"):
        head = lines[heads[0] + 1]
        assert head.startswith("  - ") and heads[0] + 2 >= len(lines) or not lines[heads[0] + 2].startswith("  - ")
    assert fragment in head, log[-3000:]
    assert "Traceback" not in log and "torch.distributed" not in log and "ChildFailedError" not in log, log[-3000:]


@pytest.mark.parametrize("case,damage,key,commands", CASES, ids=[c[0] for c in CASES])
def test_bad_folder_is_refused_before_anything_starts(root, capsys, monkeypatch, case, damage, key, commands):
    if damage is None:
        value, fragment = ("mistralai/Mistral-7B-v0.1" if key == "model.pretrained"
                           else "mistralai/Mistral-7B-Instruct-v0.1"), HUB
    else:
        shutil.copytree(root / "models" / "tiny-llama", root / "models" / case)
        value, fragment = f"models/{case}", damage(root / "models" / case)
    override = f"{key}={value}"
    if "launch" in commands:
        proc = subprocess.run(["bash", str(REPO / "launch" / "single_node.sh"), "2", *RUN, override,
                               "train.output_dir=runs/refused"], cwd=root, env=launch_env(), capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        _one_line(proc.stdout + proc.stderr, "train", fragment)
        assert not (root / "runs" / "refused").exists()
    monkeypatch.chdir(root)
    from megatron_pack.cli.export import main as export_main
    from megatron_pack.cli.prepare import main as prepare_main
    from megatron_pack.cli.verify import main as verify_main

    runs = {"prepare": lambda: prepare_main([*RUN, override, "data.dataset_dir=data/refused"]),
            "verify": lambda: verify_main([*RUN, override, "verify.num_packs=1"]),
            "export": lambda: export_main([f"model.pretrained={value}", "output=exports/refused"])}
    for command in [c for c in commands if c != "launch"]:
        code = runs[command]()
        captured = capsys.readouterr()
        assert code == 2, (command, captured.out + captured.err)
        _one_line(captured.out + captured.err, command, fragment)
    assert not (root / "data" / "refused").exists() and not (root / "exports" / "refused").exists()


def test_the_undamaged_folder_passes_every_check(root):
    """Guard: the copy every case starts from is accepted by the same checks."""
    from megatron_pack.cli.preflight import model_folder_problems, tokenizer_problems

    assert model_folder_problems(str(root / "models" / "tiny-llama"), values=True) == []
    assert tokenizer_problems(str(root / "models" / "tiny-llama")) == []
    proc = subprocess.run(["bash", "-c", f"WORLD_SIZE=2 {launch_env()['PYTHON']} -m megatron_pack.train --check "
                           + " ".join(RUN)], cwd=root, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "config ok for 2 rank(s)" in proc.stdout, proc.stdout + proc.stderr
