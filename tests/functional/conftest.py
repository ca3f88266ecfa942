"""Shared setup for functional tests: make ``tests/_dist.py`` importable as ``_dist``."""

import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def launch_workdir(tmp_path_factory) -> Path:
    """A scratch folder holding the shortened quickstart dataset at the relative path ``data``."""
    from _launch import prepare_quickstart

    workdir = tmp_path_factory.mktemp("launch") / "work"
    prepare_quickstart(workdir)
    return workdir


@pytest.fixture(scope="session")
def single_node_losses(launch_workdir) -> list[float]:
    """Per-step losses of ``launch/single_node.sh 2`` on the shortened quickstart (CP=2), run from
    ``launch_workdir`` with ``train.output_dir=ref``; the multi-node and SLURM runs must equal them."""
    from _launch import read_losses, single_node_run

    proc = single_node_run(launch_workdir, "ref")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    losses = read_losses(launch_workdir / "ref")
    assert len(losses) == 3 and len(set(losses)) == 3, losses  # three different steps really ran
    return losses
