"""``launch/slurm.sbatch`` on a real SLURM cluster started on this machine (tests/_slurm.py):
munged, slurmctld and two slurmd, submitted with ``sbatch --wait`` exactly as docs/launch.md
shows for a CPU cluster.

- one node with 2 processes (``--cpus-per-task=2``) and two nodes with 1 process each
  (``--cpus-per-task=1``), both CP=2 on the shortened quickstart for 3 steps: exit 0 and per-step
  losses equal to ``launch/single_node.sh 2`` (conftest.py), with rank 0 on node 0;
- a refused config: the job exits 2 with one message in the job log, before srun;
- ``sbatch --signal=USR1@120`` (docs/launch.md, "Signals and preemption") and ``scancel --signal=USR1``
  as soon as it trains: every rank finishes its step, saves a checkpoint there, the job exits 0.

The jobs are submitted at once and the cluster keeps finished jobs (``MinJobAge=0``): ``sbatch --wait``
then polls every 2 s (with ``MinJobAge=60`` its interval grew to 32 s, and a job done at 45 s was seen at 74 s). The Debian packages are installed when
missing; when that fails the test fails with the reason. Every daemon is stopped by its process
id when the module ends, pass or fail.
"""

from __future__ import annotations

import re
import socket
import subprocess

import numpy as np
import pytest

from _launch import REPO, TRAIN_ARGS, read_losses
from _slurm import SlurmCluster, ensure_installed, local_node_names

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CPU_1_NODE_X_2 = ["--nodes", "1", "--gpus-per-node=0", "--cpus-per-task=2"]  # as docs/launch.md, CPU cluster
CPU_2_NODES_X_1 = ["--nodes", "2", "--gpus-per-node=0", "--cpus-per-task=1"]
# (id, sbatch arguments, overrides after the shortened quickstart's)
JOBS = [  # the two-node job first, so it need not wait for a node the others fill
    ("2-nodes-x-1", CPU_2_NODES_X_1, ["train.output_dir=slurm_2x1", "checkpoint.enabled=false"]),
    ("1-node-x-2", CPU_1_NODE_X_2, ["train.output_dir=slurm_1x2", "checkpoint.enabled=false"]),
    ("refused", CPU_1_NODE_X_2, ["train.output_dir=slurm_refused", "train.lrr=0.1"]),
    ("signalled", ["--signal=USR1@120", *CPU_1_NODE_X_2], ["train.output_dir=slurm_signalled"]),
]
SIGNALLED = "signalled"
"""The job that gets ``scancel --signal=USR1`` as soon as it trains: it saves and exits 0 (docs/launch.md)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, launch_workdir, single_node_losses) -> dict:
    """Start the cluster, submit every job of JOBS with ``sbatch --wait`` from the scratch folder,
    and return {id: (sbatch exit status, job log, cluster node names)}."""
    try:
        ensure_installed()
    except RuntimeError as exc:
        pytest.fail(f"cannot run the SLURM test: {exc}")
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), local_node_names(2)) as cluster:
        running = {}
        for job_id, sbatch_args, overrides in JOBS:
            env = {**cluster.env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
                   "MASTER_PORT": str(_free_port())}  # the default 29500 may be taken on a shared CI host
            cmd = ["sbatch", "--wait", *sbatch_args, str(REPO / "launch" / "slurm.sbatch"), *TRAIN_ARGS, *overrides]
            running[job_id] = subprocess.Popen(cmd, cwd=launch_workdir, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True)
        results = {}
        try:
            first_line = {SIGNALLED: running[SIGNALLED].stdout.readline()}  # "Submitted batch job N"
            _signal_when_training(first_line[SIGNALLED], launch_workdir, cluster.env)
            for job_id, proc in running.items():
                out = first_line.get(job_id, "") + proc.communicate(timeout=240)[0]
                number = re.search(r"Submitted batch job (\d+)", out)
                assert number, f"sbatch ({job_id}): {out}\n{cluster.logs()[-3000:]}"
                log = launch_workdir / f"slurm-megatron_pack-{number.group(1)}.out"  # the documented place
                results[job_id] = (proc.returncode, log.read_text() if log.is_file() else f"(no job log {log})",
                                   cluster.node_names)
        finally:
            for proc in running.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        yield results


def _signal_when_training(submitted: str, workdir, env: dict, timeout_s: float = 200) -> None:
    """``scancel --signal=USR1 <job>`` once its log shows the ranks started (before step 1 ends)."""
    import time

    number = re.search(r"Submitted batch job (\d+)", submitted)
    assert number, submitted
    log = workdir / f"slurm-megatron_pack-{number.group(1)}.out"
    deadline = time.monotonic() + timeout_s
    while not (log.is_file() and "parallel layout:" in log.read_text()):
        assert time.monotonic() < deadline, f"job {number.group(1)} did not start training"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", number.group(1)], env=env, check=True, timeout=30)


@pytest.mark.parametrize("job_id,announce", [("1-node-x-2", "1 node(s) x 2 process(es)"),
                                             ("2-nodes-x-1", "2 node(s) x 1 process(es)")])
def test_sbatch_trains_like_single_node(job_id, announce, jobs, launch_workdir, single_node_losses):
    status, log, node_names = jobs[job_id]
    assert status == 0, log[-4000:]
    master = re.search(r"master (\S+):\d+", log)  # derived from the allocation: a node's name
    assert announce in log and master and master.group(1) in node_names, log[-3000:]
    out = next(o for j, _, overrides in JOBS if j == job_id for o in overrides if o.startswith("train.output_dir"))
    np.testing.assert_array_equal(read_losses(launch_workdir / out.split("=")[1]), single_node_losses)
    steps = [line for line in log.splitlines() if "| loss " in line]
    assert len(steps) == 3 and all(line.startswith("0: ") for line in steps), log[-3000:]  # rank 0 on node 0


@pytest.mark.parametrize("sbatch_args", [CPU_1_NODE_X_2, CPU_2_NODES_X_1], ids=["1-node-x-2", "2-nodes-x-1"])
def test_docs_show_the_tested_commands(sbatch_args):
    command = " ".join(["sbatch --wait", *sbatch_args, "launch/slurm.sbatch experiment=quickstart"])
    assert command in (REPO / "docs" / "launch.md").read_text()


def test_usr1_saves_and_ends_the_job_with_exit_0(jobs, launch_workdir):
    """``sbatch --signal=USR1@120`` as docs/launch.md shows it; ``scancel --signal=USR1`` plays the warning."""
    status, log, _ = jobs[SIGNALLED]
    assert status == 0, log[-4000:]
    stopped = re.search(r"0: megatron-pack train: stopped by SIGUSR1 after step (\d) of 3: saved checkpoint "
                        r"slurm_signalled/checkpoints/step_0000000(\d);", log)
    assert stopped and stopped.group(1) == stopped.group(2), log[-4000:]
    assert (launch_workdir / "slurm_signalled" / "checkpoints" / "latest").read_text() == f"step_0000000{stopped.group(1)}"
    assert "Traceback" not in log and "CANCELLED" not in log, log[-4000:]


def test_docs_show_the_signal_command():
    command = " ".join(["sbatch --signal=USR1@120 --wait", *CPU_1_NODE_X_2, "launch/slurm.sbatch experiment=quickstart"])
    assert command in (REPO / "docs" / "launch.md").read_text()


def test_sbatch_refuses_a_bad_config_once(jobs, launch_workdir):
    status, log, _ = jobs["refused"]
    assert status == 2, log[-3000:]
    assert log.count("megatron-pack train:") == 1 and "train.lrr" in log and "Traceback" not in log, log[-3000:]
    assert "0: " not in log  # srun never started
    assert not (launch_workdir / "slurm_refused").exists()
