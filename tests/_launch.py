"""Shared by the launch tests: the quickstart prepared once, and the reference run they compare with.

Every launch test runs from a scratch folder with RELATIVE data and output paths, so a script
that changed directory would read or write the wrong folder and fail the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The quickstart (tiny model, CP=2) shortened: 240 samples, 3 steps of 2 packs, one checkpoint at step 3.
DATA_ARGS = ["experiment=quickstart", "data.synthetic_num_samples=240", "data.dataset_dir=data"]
TRAIN_ARGS = DATA_ARGS + ["train.train_iters=3", "train.global_batch_size=2", "checkpoint.save_interval=0",
                          "logging.tensorboard=false"]


def launch_env(**extra: str) -> dict:
    """The environment the scripts get: this interpreter, one thread per process, this tree first."""
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
            "PYTHONPATH": str(REPO), **extra}


def prepare_quickstart(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "megatron_pack.cli.main", "prepare", *DATA_ARGS], cwd=workdir,
                          env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (workdir / "data").is_dir()


def read_losses(run_dir: Path) -> list[float]:
    from megatron_pack.training.metrics import read_metrics

    return [r["lm_loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


def single_node_run(workdir: Path, output_dir: str, nproc: int = 2, *extra: str) -> subprocess.CompletedProcess:
    """``bash launch/single_node.sh NPROC ...`` from ``workdir`` (the path to the script is absolute)."""
    return subprocess.run(["bash", str(REPO / "launch" / "single_node.sh"), str(nproc), *TRAIN_ARGS,
                           f"train.output_dir={output_dir}", *extra], cwd=workdir, env=launch_env(),
                          capture_output=True, text=True, timeout=300)
