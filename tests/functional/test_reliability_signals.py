"""Stop signals and killed launchers, through ``launch/single_node.sh 2`` on the shortened quickstart (CP=2).

One run folder, four launches of the same command (the 3 steps of the reference run every launch
test compares with, ``single_node_losses``):

1. SIGTERM to rank 1's worker alone, before step 1 ends: every rank stops after step 1 (rank 0
   never got the signal: the ranks agree through the per-step all-reduce), a checkpoint at step 1,
   exit 0 and the line saying so;
2. the same command resumes at step 2; SIGINT to the launcher's process group, as Ctrl-C in its terminal
   sends it (the launcher forwards it to its workers): a checkpoint at step 2, exit 130 and one line;
3. the same command again, ``kill -9`` of the launcher as soon as its two workers exist: no process
   of its tree survives a few seconds (torchrun dies with the launcher, the workers with torchrun, or,
   when torchrun died before a worker asked to die with it, the worker exits as it starts);
4. a newer checkpoint ``step_00000003`` appears with one byte flipped (same sizes: the check before
   launch sees nothing); the same command's ranks verify the checksums, pass over it with a line
   saying so, resume from step 2 and finish step 3.

The three steps' losses equal the uninterrupted run's bit for bit. Then copies of the run folder
with step 3 damaged (its optimizer part cut, its model part cut, a byte flipped): ``export`` refuses
each in one line naming the file (and the intact step 2 beside it); ``train --check`` passes over the
cut ones to step 2 and says so; a new run from their weights (``load_weights_only``) is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from _launch import REPO, TRAIN_ARGS, launch_env, read_losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
RUN = "sig"
LAUNCH_TIMEOUT_S = 150


def _tree(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *_tree(kid)]
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


class Launch:
    """``launch/single_node.sh 2 <TRAIN_ARGS> train.output_dir=sig`` from ``workdir``, read line by line."""

    def __init__(self, workdir: Path):
        self.proc = subprocess.Popen(["bash", str(REPO / "launch" / "single_node.sh"), "2", *TRAIN_ARGS,
                                      f"train.output_dir={RUN}"], cwd=workdir, env=launch_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.deadline = time.monotonic() + LAUNCH_TIMEOUT_S

    def wait_for(self, fragment: str) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if fragment in line:
                return
            assert time.monotonic() < self.deadline, f"no {fragment!r} within {LAUNCH_TIMEOUT_S} s"
        raise AssertionError(f"the run ended without {fragment!r}:\n{''.join(self.lines)[-4000:]}")

    def finish(self) -> str:
        rest, _ = self.proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
        self.lines.append(rest)
        return "".join(self.lines)

    def worker(self, rank: int) -> int:
        found = [p for p in _tree(self.proc.pid) if _rank_of(p) == rank]
        assert len(found) == 1, f"workers of rank {rank}: {found}"
        return found[0]

    def kill_tree(self) -> None:
        for pid in [self.proc.pid, *_tree(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def _workers_started(launch: Launch) -> list[int]:
    """The launcher's process tree as soon as its two workers exist (before they import torch)."""
    while time.monotonic() < launch.deadline:
        tree = _tree(launch.proc.pid)
        if len([p for p in tree if _rank_of(p) is not None]) == 2:
            return tree
        time.sleep(0.05)
    raise AssertionError(f"no two workers within {LAUNCH_TIMEOUT_S} s")


def _stopped(launch: Launch, workdir: Path, sig: str, step: int, code: int = 0) -> None:
    log = launch.finish()
    assert launch.proc.returncode == code, log[-4000:]
    line = f"megatron-pack train: stopped by {sig} after step {step} of 3: saved checkpoint {RUN}/checkpoints/"
    assert log.count(line) == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert (workdir / RUN / "checkpoints" / "latest").read_text() == f"step_{step:08d}"


def _damaged_newer_copy(root: Path) -> None:
    """A newer checkpoint ``step_00000003`` (step 2's files, ``latest`` naming it) with one byte of its
    model tensors flipped: same sizes, so only the ranks' checksums can tell."""
    shutil.copytree(root / "step_00000002", root / "step_00000003")
    model_flipped(root / "step_00000003")
    (root / "latest").write_text("step_00000003")


@pytest.fixture(scope="module")
def signalled(launch_workdir, single_node_losses):
    """The four launches of the module docstring; returns (workdir, survivors of the kill -9, reference losses)."""
    launches, survivors = [], []
    try:
        first = Launch(launch_workdir)
        launches.append(first)
        first.wait_for("parallel layout:")  # both workers have their handlers; step 1 has not ended
        os.kill(first.worker(1), signal.SIGTERM)
        _stopped(first, launch_workdir, "SIGTERM", 1)

        second = Launch(launch_workdir)
        launches.append(second)
        second.wait_for("resumed from")
        os.killpg(second.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
        _stopped(second, launch_workdir, "SIGINT", 2, code=130)

        third = Launch(launch_workdir)
        launches.append(third)
        tree = _workers_started(third)  # killed as early as possible: a worker may not have set its death signal
        os.kill(third.proc.pid, signal.SIGKILL)
        third.proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [p for p in tree if _alive(p)]

        _damaged_newer_copy(launch_workdir / RUN / "checkpoints")
        last = Launch(launch_workdir)
        launches.append(last)
        log = last.finish()
        assert last.proc.returncode == 0 and "step 3/3 | loss " in log, log[-4000:]
        assert (f"passed over: checkpoint {RUN}/checkpoints/step_00000003: __0_0.distcp (model and optimizer "
                "tensors) does not match the sha256 its manifest records") in log, log[-4000:]
        assert f"resumed from {RUN}/checkpoints/step_00000002 at step 2" in log, log[-4000:]
    finally:  # only processes this test started: a launch still running, a survivor of the kill -9
        for launch in launches:
            if launch.proc.poll() is None:
                launch.kill_tree()
        for pid in survivors:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    return launch_workdir, survivors, single_node_losses


def test_stop_signals_save_and_resume_with_the_uninterrupted_losses(signalled):
    workdir, _, reference = signalled
    assert sorted(p.name for p in (workdir / RUN / "checkpoints").glob("step_*")) == ["step_00000002",
                                                                                    "step_00000003"]
    np.testing.assert_array_equal(read_losses(workdir / RUN), reference)


def test_kill_9_of_the_launcher_leaves_no_worker(signalled):
    _, survivors, _ = signalled
    assert survivors == []


def _manifest_entry(step_dir: Path, name: str) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())["files"][name]


def optimizer_cut(step_dir: Path) -> str:
    """Cut inside the optimizer state: the model tensors before it stay whole (export read only those)."""
    holds = _manifest_entry(step_dir, "__0_0.distcp")["holds"]
    assert holds["model"] < holds["optimizer"]  # guard: DCP wrote the model tensors first
    os.truncate(step_dir / "__0_0.distcp", (holds["model"] + holds["optimizer"]) // 2)
    return "__0_0.distcp has"


def model_cut(step_dir: Path) -> str:
    os.truncate(step_dir / "__0_0.distcp", 1000)
    return "__0_0.distcp has 1,000 bytes"


def model_flipped(step_dir: Path) -> str:
    """Same size, other bytes inside a model tensor: only the checksum sees it."""
    with open(step_dir / "__0_0.distcp", "r+b") as f:
        f.seek(2000)
        byte = f.read(1)
        f.seek(2000)
        f.write(bytes([byte[0] ^ 0xFF]))
    return "__0_0.distcp (model and optimizer tensors) does not match the sha256 its manifest records"


# (id, damage of step 3, the manifest's words for it, found before launch (sizes) or only by the ranks (checksums))
DAMAGES = [("optimizer-cut", optimizer_cut, "its optimizer tensors are cut (model intact)", True),
           ("model-cut", model_cut, "its model and optimizer tensors are cut", True),
           ("model-flipped", model_flipped, "the bytes changed after the save", False)]


@pytest.mark.parametrize("damage,words,by_size", [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES])
def test_damaged_checkpoint_refused_by_export_passed_over_by_resume(signalled, monkeypatch, capsys, damage, words,
                                                                   by_size):
    from megatron_pack.cli.export import main as export_main
    from megatron_pack.cli.train import main as train_main

    workdir, _, _ = signalled
    run = f"damaged-{damage.__name__}"
    shutil.copytree(workdir / RUN, workdir / run)
    step3 = workdir / run / "checkpoints" / "step_00000003"
    fragment = damage(step3)
    monkeypatch.chdir(workdir)
    assert export_main([f"checkpoint={run}/checkpoints/step_00000003", f"output={run}-export"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatron-pack export: export.checkpoint") and fragment in err, err
    assert words in err and f"step_00000002 beside it is intact: export.checkpoint={run}/checkpoints/step_00000002" \
        in err and not (workdir / f"{run}-export").exists(), err
    monkeypatch.setenv("WORLD_SIZE", "2")  # what the launch script runs before torchrun
    assert train_main(["--check", *TRAIN_ARGS, f"train.output_dir={run}"]) == 0
    out, err = capsys.readouterr()
    resumes = "step_00000002" if by_size else "step_00000003"
    ok_line, memory = out.splitlines()  # "config ok ...", then the memory estimate
    assert ok_line.startswith("megatron-pack train: config ok for 2 rank(s); plan ") \
        and ok_line.endswith(f"; resumes from {run}/checkpoints/{resumes}"), out + err
    assert memory.startswith("megatron-pack train: memory per rank (est.): params "), out
    assert (f"megatron-pack train: passed over: checkpoint {run}/checkpoints/step_00000003: " in err) == by_size, err
    weights = ["checkpoint.load_weights_only=true", f"checkpoint.load={run}/checkpoints", "train.output_dir=fresh"]
    if by_size:  # a new run from the weights does not pass over the damaged newest checkpoint
        assert train_main(["--check", *TRAIN_ARGS, *weights]) == 2
        err = capsys.readouterr().err
        assert "does not pass over a damaged one (step_00000002 there is intact" in err and fragment in err, err
