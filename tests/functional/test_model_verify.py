"""`megatron-pack verify` end to end on a small prepared dataset.

The real path (THD attention) must PASS; the deliberately broken ``verify.attention=pack_causal``
(plain causal attention over the whole pack) must FAIL with a non-zero exit code. Weights can
come from a training checkpoint, including one written with TP=2 shards.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

NUM_PACKS = 3
DATA_ARGS = ["data=synthetic", "data.synthetic_num_samples=48", "packing.packed_sequence_size=256",
             "model.seq_length=256"]
PACK_LINE = re.compile(r"^pack (\d+): (\d+) samples, .* max \|logit diff\| (\S+)  max \|loss diff\| (\S+)  (PASS|FAIL)$")


@pytest.fixture(scope="module")
def dataset_args(tmp_path_factory) -> list[str]:
    from megatron_pack.cli.prepare import main as prepare_main

    args = DATA_ARGS + [f"data.dataset_dir={tmp_path_factory.mktemp('verify') / 'ds'}"]
    assert prepare_main(args) == 0
    return args + [f"verify.num_packs={NUM_PACKS}"]


def _pack_lines(text: str) -> list[tuple[int, int, float, float, str]]:
    found = [PACK_LINE.match(line) for line in text.splitlines()]
    return [(int(m[1]), int(m[2]), float(m[3]), float(m[4]), m[5]) for m in found if m]


def _verify_in_process(argv: list[str], capsys) -> tuple[int, str]:
    from megatron_pack.cli.verify import main as verify_main

    rc = verify_main(argv)
    return rc, capsys.readouterr().out


@pytest.mark.slow
def test_verify_console_script_passes(dataset_args):
    script = Path(sys.executable).with_name("megatron-pack")  # the installed console script
    command = [str(script)] if script.exists() else [sys.executable, "-m", "megatron_pack.cli.main"]
    proc = subprocess.run([*command, "verify", *dataset_args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    packs = _pack_lines(proc.stdout)
    assert [p[0] for p in packs] == list(range(NUM_PACKS))
    assert sum(p[1] for p in packs) > NUM_PACKS  # at least one pack held several samples
    assert all(p[4] == "PASS" and p[2] <= 1e-5 for p in packs)
    assert proc.stdout.rstrip().endswith(f"{NUM_PACKS}/{NUM_PACKS} packs PASS (tolerance 0.0001, attention thd): PASS")


@pytest.mark.slow
def test_verify_passes_with_fixed_shapes(dataset_args, capsys):
    """CUDA-graph shapes: every pack padded to the pack size, fixed-length cu_seqlens, max_seqlen = T.

    With max_seqlen equal to the pack length megatron-core's THD RoPE offsets each sub-sequence's
    positions by its start; the offset is constant per sub-sequence, so attention is unchanged.
    """
    rc, out = _verify_in_process(dataset_args + ["data.pad_to_max_length=true", "packing.pad_cu_seqlens=true"],
                                 capsys)
    packs = _pack_lines(out)
    assert rc == 0 and len(packs) == NUM_PACKS
    assert all(p[4] == "PASS" and p[2] <= 1e-5 for p in packs)


@pytest.mark.slow
def test_verify_pack_causal_fails(dataset_args, capsys):
    rc, out = _verify_in_process(dataset_args + ["verify.attention=pack_causal"], capsys)
    packs = _pack_lines(out)
    multi = [p for p in packs if p[1] > 1]
    assert multi, "no pack with several samples: the broken attention had nothing to leak"
    assert rc == 1
    assert all(p[4] == "FAIL" and p[2] > 1e-3 for p in multi)
    assert out.rstrip().endswith(": FAIL")


def _tp_shards(full: torch.Tensor, param, tp: int) -> list[torch.Tensor]:
    """The inverse of megatron's TP split (partition dim and stride), for writing a TP=2 checkpoint."""
    if not getattr(param, "tensor_model_parallel", False):
        return [full.clone() for _ in range(tp)]
    stride = getattr(param, "partition_stride", 1)
    pieces = full.chunk(stride * tp, dim=param.partition_dim)
    return [torch.cat([pieces[s * tp + r] for s in range(stride)], dim=param.partition_dim) for r in range(tp)]


def _trained_like_model(seed: int):
    """A model with weights unlike the verify default (another seed), built in a world of one."""
    from megatron_pack.config.schema import Config, ModelConfig, TrainConfig
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    cfg = Config(model=ModelConfig(attention_backend="torch", seq_length=256), train=TrainConfig(seed=seed))
    state = initialize_parallel(cfg)
    try:
        return build_model(cfg, state)
    finally:
        destroy_parallel(destroy_process_group=True)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1_checkpoint", "tp2_checkpoint"])
def test_verify_loads_checkpoint(dataset_args, tmp_path, capsys, tp):
    import torch.distributed.checkpoint as dcp

    from megatron_pack.cli.verify import load_model_weights
    from megatron_pack.training.checkpoint import save_checkpoint
    from megatron_pack.training.checkpoint_files import digest, write_manifest

    trained = _trained_like_model(seed=99)
    named = dict(trained.named_parameters())
    root = tmp_path / "ckpt"
    if tp == 1:  # the training loop's own writer
        save_checkpoint(root, 7, model_state={n: p.detach() for n, p in named.items()}, optim_state={},
                        rank_state={}, meta={"tensor_model_parallel_size": 1})
    else:  # the same layout as a TP=2 run writes: model/tp<r>/<name> shards
        state = {f"model/tp{r}/{n}": shard for n, p in named.items()
                 for r, shard in enumerate(_tp_shards(p.detach(), p, tp))}
        (root / "step_00000007").mkdir(parents=True)
        dcp.save(state, checkpoint_id=str(root / "step_00000007"), no_dist=True)
        (root / "step_00000007" / "meta.json").write_text(json.dumps({"step": 7, "tensor_model_parallel_size": tp}))
        write_manifest(root / "step_00000007", {f.name: digest(f) for f in (root / "step_00000007").iterdir()})
        (root / "latest").write_text("step_00000007")

    fresh = _trained_like_model(seed=1)
    assert any(not torch.equal(p, named[n]) for n, p in fresh.named_parameters())
    loaded_from = load_model_weights(fresh, root)
    assert loaded_from.name == "step_00000007"
    for name, param in fresh.named_parameters():
        assert torch.equal(param, named[name]), name

    rc, out = _verify_in_process(dataset_args + [f"verify.checkpoint={root}"], capsys)
    assert rc == 0 and f"weights checkpoint {root / 'step_00000007'}" in out
    assert len(_pack_lines(out)) == NUM_PACKS


@pytest.mark.slow
def test_verify_reports_a_missing_dataset(tmp_path, capsys):
    from megatron_pack.cli.verify import main as verify_main

    rc = verify_main(DATA_ARGS + [f"data.dataset_dir={tmp_path / 'nothing'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "data.dataset_dir" in err and "prepare" in err
