"""Stop signals and killed launchers, through ``launch/single_node.sh 2`` on the shortened quickstart (CP=2).

One run folder, four launches of the same command (the 3 steps of the reference run every launch
test compares with, ``single_node_losses``):

1. SIGTERM to rank 1's worker alone, before step 1 ends: every rank stops after step 1 (rank 0
   never got the signal: the ranks agree through the per-step all-reduce), a checkpoint at step 1,
   exit 0 and the line saying so;
2. the same command resumes at step 2; SIGUSR1 to the launcher (it forwards to its workers): a
   checkpoint at step 2, exit 0;
3. the same command again, ``kill -9`` of the launcher as soon as its workers train: no process of
   its tree survives a few seconds (torchrun dies with the launcher, the workers with torchrun);
4. the same command finishes step 3.

The three steps' losses equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import os
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


def _stopped(launch: Launch, workdir: Path, sig: str, step: int) -> None:
    log = launch.finish()
    assert launch.proc.returncode == 0, log[-4000:]
    line = f"megatron-pack train: stopped by {sig} after step {step} of 3: saved checkpoint {RUN}/checkpoints/"
    assert log.count(line) == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert (workdir / RUN / "checkpoints" / "latest").read_text() == f"step_{step:08d}"


@pytest.fixture(scope="module")
def signalled(launch_workdir, single_node_losses):
    """The four launches of the module docstring; returns (workdir, survivors of the kill -9, reference losses)."""
    launches = []
    try:
        first = Launch(launch_workdir)
        launches.append(first)
        first.wait_for("parallel layout:")  # both workers have their handlers; step 1 has not ended
        os.kill(first.worker(1), signal.SIGTERM)
        _stopped(first, launch_workdir, "SIGTERM", 1)

        second = Launch(launch_workdir)
        launches.append(second)
        second.wait_for("resumed from")
        os.kill(second.proc.pid, signal.SIGUSR1)
        _stopped(second, launch_workdir, "SIGUSR1", 2)

        third = Launch(launch_workdir)
        launches.append(third)
        third.wait_for("resumed from")
        tree = _tree(third.proc.pid)
        assert len([p for p in tree if _rank_of(p) is not None]) == 2, tree  # the two workers are there
        os.kill(third.proc.pid, signal.SIGKILL)
        third.proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [p for p in tree if _alive(p)]

        last = Launch(launch_workdir)
        launches.append(last)
        log = last.finish()
        assert last.proc.returncode == 0 and "step 3/3 | lm loss" in log, log[-4000:]
    finally:
        for launch in launches:
            if launch.proc.poll() is None or _tree(launch.proc.pid):
                launch.kill_tree()
    return launch_workdir, survivors, single_node_losses


def test_stop_signals_save_and_resume_with_the_uninterrupted_losses(signalled):
    workdir, _, reference = signalled
    assert sorted(p.name for p in (workdir / RUN / "checkpoints").glob("step_*")) == ["step_00000002",
                                                                                    "step_00000003"]
    np.testing.assert_array_equal(read_losses(workdir / RUN), reference)


def test_kill_9_of_the_launcher_leaves_no_worker(signalled):
    _, survivors, _ = signalled
    assert survivors == []
