"""`megatron-pack verify` end to end on a small prepared dataset.

The real path (THD attention) must PASS; the deliberately broken ``verify.attention=pack_causal``
(plain causal attention over the whole pack) must FAIL with a non-zero exit code. Weights can
come from a training checkpoint (the trainer's format), including one of the shards a TP=2 run writes.
"""

from __future__ import annotations

import os
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
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}  # every import, one line each on stderr
    proc = subprocess.run([*command, "verify", *dataset_args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "megatron.core.models.gpt" in imported
    assert "torch._dynamo" not in imported  # megatron-core's fused kernels left eager on a CPU host (cpu_compat item 4)
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


def _tp_fragments(item, param, tp: int) -> list:
    """The ShardedTensors the ``tp`` ranks of a TP=``tp`` run describe for one parameter (``item``: what the
    TP=1 run describes; ``param``: the TP=1 parameter): rank r's shard (megatron's partition dim; SwiGLU's
    ``linear_fc1`` as ``[gate_r; up_r]`` through megatron-core's factory), at offset r of ``tp`` along it."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    if not getattr(param, "tensor_model_parallel", False):
        return [item]
    built = item.build()[0] if isinstance(item, ShardedTensorFactory) else item
    pp = built.prepend_axis_num
    prepend = [(i, built.global_offset[i], built.axis_fragmentations[i]) for i in range(pp)]
    dim = int(param.partition_dim)
    if isinstance(item, ShardedTensorFactory):  # SwiGLU: rank r holds [gate_r; up_r]
        gate, up = param.detach().chunk(2, dim=dim)
        shards = [torch.cat([g, u], dim=dim) for g, u in zip(gate.chunk(tp, dim=dim), up.chunk(tp, dim=dim))]
    else:
        shards = list(param.detach().chunk(tp, dim=dim))
    fragments = [ShardedTensor.from_rank_offsets(item.key, shard.clone(), *prepend, (dim + pp, r, tp),
                                                 replica_id=0, prepend_axis_num=pp) for r, shard in enumerate(shards)]
    if isinstance(item, ShardedTensorFactory):
        return [apply_swiglu_sharded_factory(f, tuple(prepend)) for f in fragments]
    return fragments


def _trained_like_model(seed: int, checkpoint: Path | None = None, tp: int = 1):
    """A model with weights unlike the verify default (another seed), built in a world of one; with
    ``checkpoint``, saved there at step 7 as the trainer saves it (``resharding.sharded_state`` through
    ``save_checkpoint``), each parameter as the ``tp`` ranks of a TP=``tp`` run describe it."""
    from megatron_pack.config.schema import Config, ModelConfig, TrainConfig
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.checkpoint import save_checkpoint
    from megatron_pack.training.resharding import sharded_state
    from megatron_pack.training.resume import layout_meta

    cfg = Config(model=ModelConfig(attention_backend="torch", seq_length=256), train=TrainConfig(seed=seed))
    state = initialize_parallel(cfg)
    try:
        model = build_model(cfg, state)
        if checkpoint is not None:
            params = dict(model.named_parameters())
            sharded = {key: _tp_fragments(item, params[key.removeprefix("model.")], tp)
                       for key, item in sharded_state(model, {}).items()}
            assert sum(len(f) for f in sharded.values()) > len(sharded) or tp == 1  # not vacuous: shards were split
            save_checkpoint(checkpoint, 7, sharded_state=sharded, rank_state={},
                            meta=layout_meta(world_size=tp, tp=tp, cp=1, dp=1))
        return model
    finally:
        destroy_parallel(destroy_process_group=True)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1_checkpoint", "tp2_checkpoint"])
def test_verify_loads_checkpoint(dataset_args, tmp_path, capsys, tp):
    from megatron_pack.cli.verify import load_model_weights

    root = tmp_path / "ckpt"
    trained = _trained_like_model(seed=99, checkpoint=root, tp=tp)  # tp=2: the shards a TP=2 run writes
    named = dict(trained.named_parameters())

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
