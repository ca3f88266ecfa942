"""``check_resume``: a resume the run cannot do is refused by the entry before any process group
(printed once, exit 2), not on every rank inside ``Trainer.load``. A checkpoint (the trainer's
layout-free format: weights and megatron-core's optimizer state by global identity) resumes at any layout on
every device; a folder of another format (an older megatron_pack's) is refused at any layout.

Checkpoints here are only their ``meta.json`` and manifest (all the check reads); a real one written by a
CP=2 run and refused at CP=1 is in tests/functional/test_launch.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_pack.config import load_config
from megatron_pack.config.schema import ConfigError
from megatron_pack.training.checkpoint_files import SHARDED_FORMAT, digest, write_manifest
from megatron_pack.training.resume import check_resume


def _write_checkpoint(root: Path, world: int, tp: int, cp: int, step: int = 3, fmt: str | None = SHARDED_FORMAT,
                      **recorded) -> Path:
    """``fmt=None``: a meta.json without a format (an older megatron_pack's); ``recorded``: more meta.json keys."""
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True, exist_ok=True)
    meta = {"step": step, "world_size": world, "tensor_model_parallel_size": tp, "context_parallel_size": cp,
            "data_parallel_size": world // (tp * cp), **({"format": fmt} if fmt else {}), **recorded}
    (path / "meta.json").write_text(json.dumps(meta))
    write_manifest(path, {"meta.json": digest(path / "meta.json")})  # complete: its manifest is written last
    (root / "latest").write_text(path.name)
    return path


def _cfg(tmp_path: Path, tp: int, cp: int, *extra: str):
    return load_config([f"train.output_dir={tmp_path}/run", f"parallel.tensor_model_parallel_size={tp}",
                        f"parallel.context_parallel_size={cp}", *extra])


# (id, checkpoint (world, tp, cp) or None, this run (world, tp, cp))
CASES = [
    ("fresh-start", None, (2, 1, 2)),
    ("same-layout", (2, 1, 2), (2, 1, 2)),
    ("other-cp", (2, 1, 2), (2, 1, 1)),
    ("other-world", (2, 1, 2), (4, 1, 2)),
    ("other-tp", (4, 2, 2), (4, 1, 2)),
]


@pytest.mark.parametrize("saved,run", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_check_resume_at_any_layout_on_every_device(tmp_path, saved, run, device):
    """One checkpoint format (weights and optimizer state by global identity): a run resumes at any layout, on
    a GPU as on a CPU (megatron-core's optimizer state used to resume only at the layout that wrote it)."""
    world, tp, cp = run
    cfg = _cfg(tmp_path, tp, cp, f"train.device={device}")
    written = _write_checkpoint(tmp_path / "run" / "checkpoints", *saved) if saved else None
    assert check_resume(cfg, world) == written


def test_checkpoint_load_without_a_checkpoint_is_a_config_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"checkpoint.load \(.*empty\) holds no complete checkpoint"):
        check_resume(_cfg(tmp_path, 1, 2, f"checkpoint.load={tmp_path}/empty"), 2)


LAYOUTS = st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]))  # tp, cp, dp


def test_resumed_at_every_drawn_layout_on_a_gpu(tmp_path_factory):
    """Property: over drawn (tp, cp, dp) pairs, a GPU run resumes the checkpoint whatever layout wrote it."""
    outcomes = set()

    @settings(max_examples=25, deadline=None)
    @given(saved=LAYOUTS, run=LAYOUTS)
    @example(saved=(1, 2, 1), run=(1, 2, 1))
    @example(saved=(1, 2, 1), run=(2, 1, 1))  # same world size, other layout
    def prop(saved, run):
        root = tmp_path_factory.mktemp("ckpt")
        (s_tp, s_cp, s_dp), (tp, cp, dp) = saved, run
        written = _write_checkpoint(root / "run" / "checkpoints", s_tp * s_cp * s_dp, s_tp, s_cp)
        assert check_resume(_cfg(root, tp, cp, "train.device=cuda"), tp * cp * dp) == written
        outcomes.add(saved == run)

    prop()
    assert outcomes == {True, False}  # both kinds of pair were drawn


def test_checkpoint_load_names_its_key(tmp_path):
    _write_checkpoint(tmp_path / "elsewhere", 2, 1, 2, peft={"method": "lora"})
    with pytest.raises(ConfigError, match="set checkpoint.load to another directory"):
        check_resume(_cfg(tmp_path, 1, 1, f"checkpoint.load={tmp_path}/elsewhere"), 2)


@pytest.mark.parametrize("saved,run", [((2, 1, 2), (2, 1, 1)), ((4, 2, 2), (1, 1, 1)), ((2, 1, 1), (4, 2, 2))],
                         ids=["cp2-to-dp2", "tp2cp2-to-world1", "dp2-to-tp2cp2"])
def test_layout_free_checkpoint_resumes_at_another_layout_on_cpu(tmp_path, monkeypatch, saved, run):
    written = _write_checkpoint(tmp_path / "run" / "checkpoints", *saved, fmt=SHARDED_FORMAT)
    world, tp, cp = run
    assert check_resume(_cfg(tmp_path, tp, cp), world) == written


def test_older_format_names_why(tmp_path):
    """A meta.json without the trainer's format is refused at any layout, naming the folder and the way out."""
    written = _write_checkpoint(tmp_path / "run" / "checkpoints", 2, 1, 2, fmt=None)
    for tp, cp in ((1, 2), (1, 1)):  # the layout that wrote it, and another
        with pytest.raises(ConfigError) as info:
            check_resume(_cfg(tmp_path, tp, cp), 2)
        assert str(info.value).count("\n") == 1, str(info.value)  # the header and one line
        for fragment in [f"checkpoint.save (or train.output_dir) ({written}): its meta.json has format None",
                         "written by an older megatron_pack", "export it with the version that wrote it"]:
            assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("local_rank,printed", [("0", True), ("1", False)], ids=["local-rank-0", "local-rank-1"])
def test_refusal_prints_once_per_node(monkeypatch, capsys, local_rank, printed):
    from megatron_pack.cli import train

    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(train, "REFUSAL_WAIT_S", 0.0)
    assert train._refusal(ConfigError(["train.lrr: unknown key"])) == 2
    err = capsys.readouterr().err
    assert (err.count("megatron-pack train: 1 config problem(s)") == 1) == printed and (err == "") != printed


LORA = {"method": "lora", "dim": 8, "alpha": 16.0, "dropout": 0.0,
        "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "base_model": None}
# (id, peft recorded in the checkpoint, this run's peft overrides, None or fragments of the refusal)
PEFT_CASES = [
    ("full-resumes-full", None, [], None),
    ("lora-resumes-lora", LORA, ["peft=lora", "peft.dim=8", "peft.alpha=16"], None),
    ("lora-checkpoint-full-run", LORA, [], ["written with peft {'method': 'lora'", "this run has peft None"]),
    ("full-checkpoint-lora-run", None, ["peft=lora", "peft.dim=8", "peft.alpha=16"],
     ["written with peft None", "this run has peft {'method': 'lora'"]),
    ("other-rank", LORA, ["peft=lora", "peft.dim=16", "peft.alpha=16"], ["'dim': 16", "same peft.*"]),
]


@pytest.mark.parametrize("recorded,overrides,fragments", [c[1:] for c in PEFT_CASES], ids=[c[0] for c in PEFT_CASES])
def test_check_resume_peft(tmp_path, recorded, overrides, fragments):
    written = _write_checkpoint(tmp_path / "run" / "checkpoints", 2, 1, 2, peft=recorded)
    cfg = _cfg(tmp_path, 1, 2, *overrides)
    if fragments is None:
        assert check_resume(cfg, 2) == written
        return
    with pytest.raises(ConfigError) as info:
        check_resume(cfg, 2)
    for fragment in [f"cannot resume from {written}"] + fragments:
        assert fragment in str(info.value), str(info.value)


# (id, the checkpoint's (dp, data.num_workers), this run's, None or fragments of the refusal)
ONLINE_CASES = [
    ("same", (2, 2), (2, 2), None),
    ("no-worker-is-one-worker", (2, 0), (2, 1), None),
    ("other-dp", (2, 2), (1, 2), ["written at data-parallel size 2", "this run has 1", "resume with 2 data-parallel"]),
    ("other-workers", (2, 2), (2, 0), ["data.num_workers (0) differs from the checkpoint's (2)",
                                       "set data.num_workers=2 to resume", "set checkpoint.save (or train.output_dir) "
                                       "to another directory to start fresh"]),
]


@pytest.mark.parametrize("saved,run,fragments", [c[1:] for c in ONLINE_CASES], ids=[c[0] for c in ONLINE_CASES])
def test_online_resume_needs_the_same_dp_size_and_workers(tmp_path, monkeypatch, saved, run, fragments):
    """Online shards are ``dp_rank * W + w`` of ``dp * W``: refused before any process group, in one line."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    loader = {"kind": "online", "version": 2, "dp_size": saved[0], "num_workers": saved[1]}
    written = _write_checkpoint(tmp_path / "run" / "checkpoints", saved[0], 1, 1, fmt=SHARDED_FORMAT,
                                train_state={"loader": loader})
    cfg = _cfg(tmp_path, 1, 1, "packing.mode=online", f"data.num_workers={run[1]}")
    if fragments is None:
        assert check_resume(cfg, run[0]) == written
        return
    with pytest.raises(ConfigError) as info:
        check_resume(cfg, run[0])
    message = str(info.value)
    assert f"cannot resume from {written}" in message and message.count("\n") <= 1, message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("keys,refused", [(["model.w"], True), (["model.w", "optimizer.exp_avg.w"], False)],
                         ids=["older-gpu-checkpoint-without-moments", "moments-by-parameter"])
def test_checkpoint_without_optimizer_state_refused_before_launch(tmp_path, keys, refused):
    """A GPU run of an older megatron_pack saved megatron-core's per-rank optimizer state (no Adam moments): its
    checkpoint is refused in one line naming the way out, not resumed on uninitialised moments."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = _write_checkpoint(tmp_path / "run" / "checkpoints", 1, 1, 1)
    dcp.save({key: torch.ones(2) for key in keys}, checkpoint_id=str(path), no_dist=True)
    write_manifest(path, {name: digest(path / name) for name in sorted(p.name for p in path.iterdir())
                          if name != "manifest.json"})
    cfg = _cfg(tmp_path, 1, 1)
    if not refused:
        assert check_resume(cfg, 1) == path
        return
    with pytest.raises(ConfigError) as info:
        check_resume(cfg, 1)
    message = str(info.value)
    assert "holds no optimizer state by parameter" in message and "checkpoint.load_weights_only=true" in message
    assert message.count("\n") == 1, message
