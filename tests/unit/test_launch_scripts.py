"""The launch scripts' own logic, with stand-ins for Python, ``scontrol`` and ``srun``.

A fake interpreter answers the GPU probe (``gloo``: no GPU), records the ``--check`` call (with the
world size it was given) and prints the torchrun command it would run; fake ``scontrol`` /
``srun`` play a SLURM allocation. Each case is hand-computed: which processes per node, which
rendezvous host and port, which node rank, which world size the config is checked for, and
that the scripts stay in the caller's folder. Real runs: tests/functional/test_launch.py and
test_slurm.py.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$3" = backend ]; then echo gloo; exit 0; fi        # megatron_pack.cli.launch backend: no GPU
if [ "$3" = --check ]; then echo "CHECK world=$WORLD_SIZE cwd=$PWD" >&2; exit "${FAKE_CHECK_RC:-0}"; fi
echo "RUN cwd=$PWD $*"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$2" in
  job) echo "   Command=$FAKE_SCRIPT WorkDir=$PWD" ;;
  hostnames) tr ',' '\\n' <<< "$3" ;;
  node) echo "   NodeAddr=10.1.2.3 NodeHostName=$3 Version=22.05.8" ;;
esac
"""
FAKE_SRUN = """#!/usr/bin/env bash
echo "SRUN $*"
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=1 "$@"                                    # what the task on the second node runs
"""


@pytest.fixture()
def fakes(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NPROC", "FAKE_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHON=str(bin_dir / "python"),
               FAKE_SCRIPT=str(REPO / "launch" / "slurm.sbatch"))
    return {"env": env, "work": work}


def _run(fakes: dict, script: str, args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / script), *args, "experiment=quickstart"],
                          cwd=fakes["work"], env={**fakes["env"], **env}, capture_output=True, text=True, timeout=30)


JOB = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "localhost,node2"}
# (id, environment of the job, processes per node, master host, master port)
SLURM_CASES = [
    ("gpus-on-node", {"SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "32"}, 8, "localhost", 29500),
    ("cpu-cluster", {"SLURM_GPUS_PER_NODE": "0", "SLURM_CPUS_PER_TASK": "4", "SLURM_CPUS_ON_NODE": "4"},
     4, "localhost", 29500),
    ("cpus-on-node-only", {"SLURM_CPUS_ON_NODE": "3"}, 3, "localhost", 29500),
    ("explicit", {"NPROC_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "8", "MASTER_ADDR": "ib0-host",
                  "MASTER_PORT": "1234"}, 2, "ib0-host", 1234),
    ("unresolvable-first-node", {"SLURM_JOB_NODELIST": "nosuchnode-a1,nosuchnode-a2", "SLURM_CPUS_PER_TASK": "1"},
     1, "10.1.2.3", 29500),  # the node's NodeAddr
]


@pytest.mark.parametrize("job_env,nproc,host,port", [c[1:] for c in SLURM_CASES], ids=[c[0] for c in SLURM_CASES])
def test_sbatch_derives_processes_and_rendezvous(fakes, job_env, nproc, host, port):
    proc = _run(fakes, "slurm.sbatch", [], **{**JOB, "SLURM_SUBMIT_DIR": str(fakes["work"]), **job_env})
    assert proc.returncode == 0, proc.stderr
    work = fakes["work"]
    assert f"CHECK world={2 * nproc} cwd={work}" in proc.stderr  # checked once, for the whole job, before srun
    srun = next(line for line in proc.stdout.splitlines() if line.startswith("SRUN"))
    assert "--ntasks-per-node=1" in srun and "--kill-on-bad-exit=1" in srun
    run = next(line for line in proc.stdout.splitlines() if line.startswith("RUN"))
    assert run.startswith(f"RUN cwd={work} -m megatron_pack.cli.launch torchrun --node-rank 1 --nnodes 2 "
                          f"--nproc-per-node {nproc} --master-addr {host} --master-port {port} "
                          "-m megatron_pack.train parallel.backend=gloo experiment=quickstart"), run
    assert f"2 node(s) x {nproc} process(es), master {host}:{port}" in proc.stdout


SLURM_REFUSALS = [
    ("outside-a-job", {}, "not inside a SLURM job"),
    ("no-process-count", {**JOB, "SLURM_GPUS_ON_NODE": "0"}, "processes per node unknown"),
    ("config-refused", {**JOB, "SLURM_CPUS_PER_TASK": "1", "FAKE_CHECK_RC": "2"}, "CHECK world=2"),
]


@pytest.mark.parametrize("job_env,fragment", [c[1:] for c in SLURM_REFUSALS], ids=[c[0] for c in SLURM_REFUSALS])
def test_sbatch_refuses_with_exit_2_before_srun(fakes, job_env, fragment):
    proc = _run(fakes, "slurm.sbatch", [], SLURM_SUBMIT_DIR=str(fakes["work"]), **job_env)
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr
    assert "SRUN" not in proc.stdout and "unbound variable" not in proc.stderr


@pytest.mark.parametrize("script,args,world,torchrun", [
    ("single_node.sh", ["2"], 2, "--standalone --nproc-per-node 2"),
    ("multi_node.sh", ["2", "1", "10.0.0.1:29500", "4"], 8,
     "--nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 4"),
], ids=["single-node", "multi-node"])
def test_scripts_stay_in_callers_folder_and_check_first(fakes, script, args, world, torchrun):
    proc = _run(fakes, script, args)
    assert proc.returncode == 0, proc.stderr
    work = fakes["work"]
    assert proc.stderr.count("CHECK") == 1 and f"CHECK world={world} cwd={work}" in proc.stderr
    assert proc.stdout.strip() == (f"RUN cwd={work} -m megatron_pack.cli.launch torchrun {torchrun} -m megatron_pack.train "
                                   "parallel.backend=gloo experiment=quickstart")


@pytest.mark.parametrize("script,args,fragment", [
    ("single_node.sh", ["2"], None),
    ("multi_node.sh", ["2", "0", "10.0.0.1:29500", "1"], None),
    ("multi_node.sh", ["2", "0", "10.0.0.1", "1"], "needs a port, e.g. 10.0.0.1:29500"),
], ids=["single-node-refused", "multi-node-refused", "multi-node-no-port"])
def test_scripts_exit_2_before_torchrun(fakes, script, args, fragment):
    proc = _run(fakes, script, args, FAKE_CHECK_RC="2")
    assert proc.returncode == 2, proc.stderr
    assert "RUN" not in proc.stdout
    if fragment:
        assert fragment in proc.stderr and "CHECK" not in proc.stderr


def test_job_log_is_documented_and_ignored():
    text = (REPO / "launch" / "slurm.sbatch").read_text()
    assert re.search(r"^#SBATCH --output=slurm-%x-%j.out$", text, re.M)
    assert "slurm-megatron_pack-<jobid>.out" in (REPO / "docs" / "launch.md").read_text()
    ignored = subprocess.run(["git", "check-ignore", "-q", "slurm-megatron_pack-123.out"], cwd=REPO)
    assert ignored.returncode == 0
