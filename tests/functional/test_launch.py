"""The launch scripts end to end on CPU (gloo), from a scratch folder with relative paths.

1. ``launch/single_node.sh 2`` resolves relative data and output paths against the caller's
   folder (the reference run every other launch test compares with, see conftest.py).
2. ``launch/multi_node.sh`` as two node agents on this machine (``--nnodes 2``, master on
   127.0.0.1, one process each) trains the same 3 steps as the single-node world of 2: equal
   losses, and global rank 0 (the metrics writer) is on node 0.
3. A refused config or a resume on another layout, through the scripts: one clean message,
   exit 2, torchrun never starts. Under bare torchrun: one message, every worker exits 2.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import numpy as np
import pytest

from _launch import REPO, TRAIN_ARGS, launch_env, read_losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_single_node_writes_relative_paths_in_callers_folder(launch_workdir, single_node_losses):
    run = launch_workdir / "ref"
    assert (run / "metrics.jsonl").is_file() and (run / "checkpoints" / "step_00000003" / "meta.json").is_file()
    assert not (REPO / "ref").exists()  # the script did not run from the repository root


def test_multi_node_two_agents_equal_single_node(launch_workdir, single_node_losses):
    master = f"127.0.0.1:{_free_port()}"
    args = [*TRAIN_ARGS, "train.output_dir=multi", "checkpoint.enabled=false"]
    script = str(REPO / "launch" / "multi_node.sh")
    # node 1 starts first: with a join-order rendezvous it would take rank 0
    agents = [subprocess.Popen(["bash", script, "2", str(node), master, "1", *args], cwd=launch_workdir,
                               env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for node in (1, 0)]
    logs = {}
    try:
        for node, agent in zip((1, 0), agents):
            logs[node] = agent.communicate(timeout=300)[0]
            assert agent.returncode == 0, f"node {node}:\n{logs[node][-4000:]}"
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    np.testing.assert_array_equal(read_losses(launch_workdir / "multi"), single_node_losses)
    assert "step 3/3 | loss" in logs[0] and "parallel layout: world 2 = dp 1 x cp 2" in logs[0]
    assert "| loss" not in logs[1]  # rank 0 is node 0's process, whichever agent joined first


# (id, script arguments before the overrides, extra overrides, fragment the one message must hold)
REFUSALS = [
    ("single-node-typo", ["single_node.sh", "2"], ["train.lrr=0.1"], "train.lrr"),
    ("single-node-world", ["single_node.sh", "3"], [], "world size (3)"),
    ("multi-node-typo", ["multi_node.sh", "1", "0", "127.0.0.1:{port}", "2"], ["train.lrr=0.1"], "train.lrr"),
    ("resume-changed-settings", ["single_node.sh", "2"], ["train.weight_decay=0.5", "train.output_dir=ref"],
     "resuming ref/checkpoints/step_00000003 with changed settings (train.weight_decay: 0.01 -> 0.5)"),
]


@pytest.mark.parametrize("script,overrides,fragment", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_scripts_refuse_once_with_exit_2(script, overrides, fragment, launch_workdir, single_node_losses):
    script = [str(REPO / "launch" / script[0])] + [a.format(port=_free_port()) for a in script[1:]]
    train_args = [a for a in TRAIN_ARGS if not a.startswith("train.output_dir")]
    output = [] if any(o.startswith("train.output_dir") for o in overrides) else ["train.output_dir=refused"]
    proc = subprocess.run(["bash", *script, *train_args, *output, *overrides], cwd=launch_workdir,
                          env=launch_env(), capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert log.count("megatron-pack train:") == 1 and fragment in log, log[-3000:]
    assert "Traceback" not in log and "torch.distributed" not in log  # torchrun never started
    assert not (launch_workdir / "refused").exists()


TORCHRUN_REFUSALS = [
    ("typo", ["train.lrr=0.1", "train.output_dir=refused"], "train.lrr"),
    ("resume-changed-settings", ["train.weight_decay=0.5", "train.output_dir=ref"],
     "resuming ref/checkpoints/step_00000003 with changed settings (train.weight_decay: 0.01 -> 0.5)"),
]


@pytest.mark.parametrize("overrides,fragment", [c[1:] for c in TORCHRUN_REFUSALS],
                         ids=[c[0] for c in TORCHRUN_REFUSALS])
def test_bare_torchrun_prints_once_and_workers_exit_2(overrides, fragment, launch_workdir, single_node_losses):
    """Without the scripts' pre-check torchrun does start; the entry still refuses before any
    process group, prints once per node, and every worker exits 2 (torchrun's own summary and
    exit status 1 follow: docs/launch.md)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_pack.train", *TRAIN_ARGS[:-1], "parallel.backend=gloo", *overrides]
    proc = subprocess.run(cmd, cwd=launch_workdir, env=launch_env(), capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert log.count("megatron-pack train:") == 1 and fragment in log, log[-3000:]
    assert "exitcode  : 2" in log, log[-3000:]  # the root cause torchrun names: a worker's exit 2
    # the one traceback is torchrun's own report, none comes from a worker
    assert log.count("Traceback (most recent call last)") == 1 and "ChildFailedError" in log, log[-3000:]
    assert not (launch_workdir / "refused").exists()


def test_check_flag_accepts_a_good_config(launch_workdir, single_node_losses, monkeypatch, capsys):
    from megatron_pack.cli.train import main

    monkeypatch.chdir(launch_workdir)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--check", *TRAIN_ARGS, "train.output_dir=ref"]) == 0
    out = capsys.readouterr().out
    assert "config ok for 2 rank(s); plan data/plans/pack512_mult4_" in out  # what it would train on
    assert "; resumes from ref/checkpoints/step_00000003" in out
