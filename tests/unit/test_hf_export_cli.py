"""`megatron-pack export`: the round trip of a folder with no checkpoint, and every user mistake as one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf import make_family  # noqa: E402


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    return make_family(tmp_path_factory.mktemp("hf_export"), "qwen2_bias", seed=3, dtype=torch.bfloat16)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_round_trip_without_checkpoint_is_bit_exact(qwen2, tmp_path, capsys):
    from megatron_pack.cli.export import main

    out = tmp_path / "rt"
    assert main([f"model.pretrained={qwen2}", f"output={out}", "export.max_shard_size=100KB"]) == 0
    assert "round trip" in capsys.readouterr().out
    source, exported = _tensors(qwen2), _tensors(out)
    assert len(source) > 15 and sorted(source) == sorted(exported)
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], source[k]) for k in source)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source) and len(set(index["weight_map"].values())) > 1
    assert (out / "generation_config.json").read_text() == (qwen2 / "generation_config.json").read_text()
    assert (out / "tokenizer.json").read_text() == (qwen2 / "tokenizer.json").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_the_console_command_leaves_megatron_cores_fused_kernels_eager_on_a_cpu_host(qwen2, tmp_path):
    """Reading a sharded or LoRA checkpoint imports megatron-core, whose fused kernels import TorchDynamo and
    Inductor for ``torch.compile`` (2.7 CPU-s a process): the command installs cpu_compat's eager ``jit_fuser``
    before anything can import megatron-core (its module in ``sys.modules`` at the end is cpu_compat's)."""
    import os
    import subprocess

    code = ("import sys; from megatron_pack.cli.main import main; "
            f"rc = main(['export', 'model.pretrained={qwen2}', 'output={tmp_path / 'rt'}']); assert rc == 0, rc; "
            "jit = sys.modules.get('megatron.core.jit'); print('jit:', jit and jit.__doc__); "
            "print('dynamo:', 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(megatron_pack.model.cpu_compat)" in out.stdout and "dynamo: False" in out.stdout, out.stdout


def test_export_dtype_override(qwen2, tmp_path):
    from megatron_pack.cli.export import main

    assert main([f"model.pretrained={qwen2}", f"output={tmp_path / 'f32'}", "export.dtype=float32"]) == 0
    tensors = _tensors(tmp_path / "f32")
    assert (tmp_path / "f32" / "model.safetensors").is_file()  # one shard under the default cap: no index
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert all(torch.equal(tensors[k].bfloat16(), v) for k, v in _tensors(qwen2).items())


MISTAKES = [  # (id, argv (formatted with the folder and tmp), fragments of the one-line message)
    ("no-output", ["model.pretrained={src}"], ["export.output (None) is required", "output=DIR"]),
    ("nothing-to-export", ["output={tmp}/o"], ["checkpoint=RUN/checkpoints", "model.pretrained=DIR"]),
    ("no-checkpoint-there", ["checkpoint={tmp}/none", "output={tmp}/o"], ["holds no complete checkpoint"]),
    ("checkpoint-without-hf-source", ["checkpoint={tmp}/ck", "output={tmp}/o"],
     ["no hf_source/", "pass model.pretrained="]),
    ("output-not-empty", ["model.pretrained={src}", "output={tmp}/full"], ["exists and is not empty"]),
    ("bad-dtype", ["model.pretrained={src}", "output={tmp}/o", "export.dtype=float16"], ["export.dtype ('float16')"]),
    ("typo", ["model.pretrained={src}", "output={tmp}/o", "export.dtpye=bfloat16"], ["did you mean 'export.dtype'"]),
    ("adapter-of-full-checkpoint", ["checkpoint={tmp}/ck", "model.pretrained={src}", "output={tmp}/o",
                                    "export.adapter=true"], ["is a full fine-tuning checkpoint", "drop export.adapter"]),
    ("lora-checkpoint-without-flag", ["checkpoint={tmp}/lora", "model.pretrained={src}", "output={tmp}/o"],
     ["holds LoRA adapters only", "export.adapter=true", "export.merge=true"]),
    ("merge-without-base-weights", ["checkpoint={tmp}/lora", "output={tmp}/o", "export.merge=true"],
     ["holds no safetensors", "pass model.pretrained="]),
    ("adapter-and-merge", ["checkpoint={tmp}/lora", "model.pretrained={src}", "output={tmp}/o", "export.adapter=true",
                           "export.merge=true"], ["choose one"]),
    ("adapter-without-checkpoint", ["model.pretrained={src}", "output={tmp}/o", "export.adapter=true"],
     ["need checkpoint=RUN/checkpoints", "peft=lora"]),
]


@pytest.mark.parametrize("argv,fragments", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_mistakes_are_one_line(qwen2, tmp_path, capsys, argv, fragments):
    from megatron_pack.cli.export import main
    from megatron_pack.training.checkpoint_files import SHARDED_FORMAT, digest, write_manifest

    (tmp_path / "ck" / "step_00000001").mkdir(parents=True)
    (tmp_path / "ck" / "step_00000001" / "meta.json").write_text(json.dumps({"step": 1, "format": SHARDED_FORMAT}))
    (tmp_path / "ck" / "latest").write_text("step_00000001")
    lora = tmp_path / "lora" / "step_00000002"
    lora.mkdir(parents=True)
    (lora / "meta.json").write_text(json.dumps({"step": 2, "format": SHARDED_FORMAT,
                                                "peft": {"method": "lora", "dim": 4, "alpha": 8.0, "dropout": 0.0,
                                                         "target_modules": ["linear_qkv"],
                                                         "base_model": str(tmp_path / "gone")}}))
    (tmp_path / "lora" / "hf_source").mkdir()
    (tmp_path / "lora" / "hf_source" / "config.json").write_text((qwen2 / "config.json").read_text())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    for step_dir in (tmp_path / "ck" / "step_00000001", lora):  # complete: a manifest of their files
        write_manifest(step_dir, {"meta.json": digest(step_dir / "meta.json")})
    assert main([a.format(src=qwen2, tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-pack export:") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "o").exists()


def test_checkpoint_tensors_without_a_name_are_refused(qwen2):
    from megatron_pack.config.hf_config import apply_pretrained
    from megatron_pack.config.schema import Config, ModelConfig
    from megatron_pack.model.hf.export import hf_tensors, shards_from_pretrained

    cfg = apply_pretrained(Config(model=ModelConfig(pretrained=str(qwen2))), [])
    shards = shards_from_pretrained(qwen2, cfg.model, tp=2)
    for shard in shards:
        shard["decoder.layers.0.self_attention.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="extra.weight.*nothing is dropped silently"):
        hf_tensors(shards, "qwen2", cfg.model)
