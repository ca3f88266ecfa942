"""Crashes: ``kill -9`` at chosen points of ``prepare`` and of a checkpoint save.

Each kill point runs in its own Python process that patches one function of the writer to send
itself SIGKILL (a real ``kill -9``: no ``finally``, no ``atexit``), so the point is exact and the
test does not depend on timing. One driver process per table imports once and forks a child per
kill point. Afterwards the parent checks what a reader finds:

* prepare (a previous dataset built from input A is being replaced by input B): the target
  holds the previous complete dataset A, or nothing, or the new store B with no plan (a clear
  refusal); never a half-written one. Re-running ``prepare`` then gives exactly what a clean run
  gives, and removes the killed writer's hidden temporaries.
* checkpoint (step 1 complete, step 2 being saved): ``find_latest`` names a complete checkpoint
  whose tensors load bit for bit (the previous one, or the new one once it is complete), and the
  next save succeeds and cleans up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

PREPARE_DRIVER = textwrap.dedent("""
    # imports once; each kill point runs in a forked child that SIGKILLs itself at its point
    import json, os, signal, sys
    from megatron_pack.config import Config, DataConfig, PackingConfig
    from megatron_pack.data import prepare
    from megatron_pack.data.packing import plan, report
    from megatron_pack.data.store import atomic
    source, base, points = sys.argv[1], sys.argv[2], sys.argv[3:]

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def first_chunk_then_die(*args, **kwargs):
        yield next(real_stream(*args, **kwargs))
        die()

    real_stream, real_rename, num_renames = prepare.tokenize_stream, os.rename, [0]

    def rename_then_die(src, dst):
        num_renames[0] += 1
        if num_renames[0] == 2:  # the old store is renamed away, the new one not yet in place
            die()
        real_rename(src, dst)

    patches = {"tokenizing": (prepare, "tokenize_stream", first_chunk_then_die),
               "store-arrays-written": (prepare, "store_statistics", die),
               "store-complete-not-renamed": (atomic, "_fsync_tree", die),
               "store-swap": (atomic.os, "rename", rename_then_die),
               "plan-arrays-written": (plan, "write_json", die),
               "report": (report, "_plot", die)}
    status = {}
    for point in points:
        pid = os.fork()
        if pid == 0:
            module, name, fake = patches[point]
            setattr(module, name, fake)
            target = os.path.join(base, point, "ds")
            cfg = Config(data=DataConfig(source="files", input=source, dataset_dir=target, tokenize_workers=1,
                                         overwrite=True),  # B replaces A's store: said explicitly
                         packing=PackingConfig(packed_sequence_size=128))
            prepare.prepare(cfg, progress=False)
            os._exit(3)  # prepare finished without reaching the kill point
        _, code = os.waitpid(pid, 0)
        status[point] = -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)
    print(json.dumps(status))
""")

# point -> what a reader must find afterwards
PREPARE_POINTS = {
    "tokenizing": "previous",
    "store-arrays-written": "previous",
    "store-complete-not-renamed": "previous",
    "store-swap": "none",
    "plan-arrays-written": "new-store-no-plan",
    "report": "new-complete",
}


def _records(n: int, tag: str) -> list[dict]:
    return [{"prompt": f"{tag} question {i} " + "q" * (i % 37), "completion": f"answer {i} " + "a" * (i % 23)}
            for i in range(n)]


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _cfg(source: Path, target: Path):
    from megatron_pack.config import Config, DataConfig, PackingConfig

    return Config(data=DataConfig(source="files", input=str(source), dataset_dir=str(target), tokenize_workers=1,
                                  overwrite=True),  # B replaces A's store (data.overwrite, issue 34)
                  packing=PackingConfig(packed_sequence_size=128))


def _run_driver(driver: str, argv: list[str], cwd: Path) -> dict[str, int]:
    """Run a kill driver; returns point -> exit status of its child (-9: killed by SIGKILL)."""
    tests = str(Path(__file__).resolve().parents[1])  # _checkpoints
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), tests) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", driver, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _samples(dataset) -> list[tuple[int, list[int]]]:
    return sorted((s["sample_id"], s["input_ids"].tolist()) for i in range(len(dataset)) for s in dataset[i])


def _tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every array and of the plan layout (metadata holds timings, so it is left out)."""
    from megatron_pack.data.store.atomic import sha256_file

    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*.npy"))}


def _fingerprint(dataset_dir: Path) -> str:
    return json.loads((dataset_dir / "metadata.json").read_text())["fingerprint"]


def _reader_state(target: Path, cfg_b, fingerprints: dict[str, str]) -> str:
    """What a training job pointed at ``target`` finds: previous / none / new-store-no-plan / new-complete."""
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.formats.sources import DataError

    if not target.exists():
        return "none"
    which = {v: k for k, v in fingerprints.items()}.get(_fingerprint(target))
    assert which is not None, f"{target} holds neither dataset A nor B: {sorted(os.listdir(target))}"
    try:
        PackedSFTDataset.from_config(cfg_b)  # verifies format, every checksum, the tokenizer
    except DataError as exc:
        if which == "b" and "has no packing plan" in str(exc):
            return "new-store-no-plan"
        if which == "b":
            raise
    return "previous" if which == "a" else "new-complete"


@pytest.fixture(scope="module")
def prepare_kills(tmp_path_factory):
    """Dataset A prepared once; every kill point replaces a copy of it with B and is killed."""
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.prepare import prepare

    root = tmp_path_factory.mktemp("prepare_kills")
    source_a, source_b = _write(root / "a.jsonl", _records(300, "A")), _write(root / "b.jsonl", _records(400, "B"))
    prepare(_cfg(source_a, root / "ref_a"), progress=False)
    prepare(_cfg(source_b, root / "ref_b"), progress=False)
    expected = {"a": _samples(PackedSFTDataset.from_config(_cfg(source_a, root / "ref_a"))),
                "b": _samples(PackedSFTDataset.from_config(_cfg(source_b, root / "ref_b"))),
                "b_digest": _tree_digest(root / "ref_b"),
                "fingerprints": {"a": _fingerprint(root / "ref_a"), "b": _fingerprint(root / "ref_b")}}
    for point in PREPARE_POINTS:
        shutil.copytree(root / "ref_a", root / point / "ds")
    return root, expected, _run_driver(PREPARE_DRIVER, [str(source_b), str(root), *PREPARE_POINTS], root)


@pytest.mark.slow
@pytest.mark.parametrize("point", list(PREPARE_POINTS), ids=list(PREPARE_POINTS))
def test_kill_during_prepare_leaves_previous_or_none(prepare_kills, point):
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.prepare import prepare

    root, expected, status = prepare_kills
    assert status[point] == -9, f"not killed at {point}: exit status {status[point]}"
    target = root / point / "ds"
    cfg_a, cfg_b = _cfg(root / "a.jsonl", target), _cfg(root / "b.jsonl", target)
    state = _reader_state(target, cfg_b, expected["fingerprints"])
    assert state == PREPARE_POINTS[point]
    if state == "previous":
        assert _samples(PackedSFTDataset.from_config(cfg_a)) == expected["a"]  # A whole, not a mix
    leftovers = list(target.parent.glob(".ds.tmp-*")) + list(target.glob("plans/.*.tmp-*"))
    if state != "new-complete":
        assert leftovers, "the kill left no hidden temporary: did it really interrupt a write?"
    # a re-run completes B exactly as a clean run does and removes the dead writer's temporaries
    plan_dir = prepare(cfg_b, progress=False)
    assert _samples(PackedSFTDataset.from_config(cfg_b)) == expected["b"]
    assert _tree_digest(target) == expected["b_digest"]
    assert (plan_dir / "report.json").is_file() and (plan_dir / "report.png").is_file()
    assert not list(target.parent.glob(".ds.tmp-*")) and not list(target.glob("plans/.*.tmp-*"))


CHECKPOINT_DRIVER = textwrap.dedent("""
    # torch and megatron-core are imported once; each kill point runs in a forked child that SIGKILLs itself
    import json, os, shutil, signal, sys
    import torch
    import megatron.core.dist_checkpointing.strategies.torch
    from _checkpoints import save, world_of_one
    from megatron_pack.training import checkpoint as ckpt
    base, step, points = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def die_on_call(n, real):
        calls = [0]
        def fake(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                die()
            return real(*args, **kwargs)
        return fake

    def rmtree_then_die(path, *args, **kwargs):
        real_rmtree(path, *args, **kwargs)
        if os.path.basename(str(path)) == ckpt.step_dirname(step):
            die()

    real_rmtree = shutil.rmtree
    patches = {"dcp-writing": (os, "fsync", die), "rank-file": (torch, "save", die),
               "meta": (ckpt, "_write_json", die), "manifest": (os, "replace", die_on_call(2, os.replace)),
               "rename": (os, "replace", die_on_call(3, os.replace)),
               "latest-pointer": (os, "replace", die_on_call(4, os.replace)), "prune": (ckpt, "_prune", die),
               "resave-same-step": (shutil, "rmtree", rmtree_then_die)}
    status = {}
    for point in points:
        pid = os.fork()
        if pid == 0:
            module, name, fake = patches[point]
            setattr(module, name, fake)
            model = {"w": torch.full((4, 3), float(step)), "b": torch.arange(3, dtype=torch.float32) + step}
            optim = {"exp_avg.w": torch.full((4, 3), step / 10)}
            with world_of_one():
                save(os.path.join(base, point), step, model, optim, rank_state={"step": step}, meta={}, keep_last=2)
            os._exit(3)  # the save finished without reaching the kill point
        _, code = os.waitpid(pid, 0)
        status[point] = -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)
    print(json.dumps(status))
""")

# point -> step a reader must load afterwards (step 1 complete before; step 2 being written)
CHECKPOINT_POINTS = {"dcp-writing": 1, "rank-file": 1, "meta": 1, "manifest": 1, "rename": 1, "latest-pointer": 1,
                     "prune": 2, "resave-same-step": 1}


def _state(step: int):
    import torch

    return ({"w": torch.full((4, 3), float(step)), "b": torch.arange(3, dtype=torch.float32) + step},
            {"exp_avg.w": torch.full((4, 3), step / 10)})


def _save(root: Path, step: int) -> Path:
    """What the trainer's save writes (``_checkpoints``), in a world of one."""
    from _checkpoints import save, world_of_one

    with world_of_one():
        return save(root, step, *_state(step), rank_state={"step": step}, meta={}, keep_last=2)


def _load_latest(root: Path) -> tuple[int, dict, dict]:
    """The newest complete checkpoint read by the trainer's reader: (its step, model, optimizer state)."""
    import torch
    from _checkpoints import load, world_of_one

    from megatron_pack.training.checkpoint import read_rank_state
    from megatron_pack.training.checkpoint_files import find_latest

    path = find_latest(root)
    assert path is not None, f"no loadable checkpoint left in {root}: {sorted(os.listdir(root))}"
    with world_of_one():
        model, optim = load(path, {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, {"exp_avg.w": torch.zeros(4, 3)})
    return int(read_rank_state(path)["step"]), model, optim


@pytest.fixture(scope="module")
def checkpoint_kills(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint_kills")
    for point in CHECKPOINT_POINTS:
        _save(root / point, 1)
        if point == "resave-same-step":  # a resumed run saving the step it already saved once
            _save(root / point, 2)
    return root, _run_driver(CHECKPOINT_DRIVER, [str(root), "2", *CHECKPOINT_POINTS], root)


@pytest.mark.slow
@pytest.mark.parametrize("point", list(CHECKPOINT_POINTS), ids=list(CHECKPOINT_POINTS))
def test_kill_during_checkpoint_save_keeps_a_loadable_checkpoint(checkpoint_kills, point):
    import torch

    root, status = checkpoint_kills
    assert status[point] == -9, f"not killed at {point}: exit status {status[point]}"
    step, model, optim = _load_latest(root / point)
    assert step == CHECKPOINT_POINTS[point]
    want_model, want_optim = _state(step)
    for got, want in ((model, want_model), (optim, want_optim)):
        for key in want:
            assert torch.equal(got[key], want[key]), (point, key)
    # the next save works and clears the killed writer's temporary folder
    _save(root / point, 3)
    assert _load_latest(root / point)[0] == 3
    assert not list((root / point).glob("tmp.step_*"))
