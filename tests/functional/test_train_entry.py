"""The train entry refuses a bad run before building anything; the launch scripts parse.

In-process calls of ``megatron_pack.cli.train.main`` (no torchrun): each case must exit with
status 2 and a message naming the key or the command to run, and leave torch.distributed
uninitialised (nothing was built).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]

CASES = [
    # (id, world size, overrides, expected fragments of the message)
    ("batch-not-divisible", "2", ["parallel=cp1", "train.global_batch_size=3"],
     ["train.global_batch_size (3)", "set train.global_batch_size=4"]),
    ("world-not-divisible", "3", ["parallel=cp2"], ["world size (3)", "parallel.context_parallel_size"]),
    ("no-dataset", "2", ["data.dataset_dir={tmp}/nothing"], ["holds no prepared dataset", "megatron-pack prepare"]),
    ("typo", "2", ["train.lrr=0.1"], ["train.lrr", "train.lr"]),
    ("virtual-stages-layers", "2", ["parallel=pp2_vp2"],
     ["model.num_layers (2) must be a multiple of parallel.pipeline_model_parallel_size (2) x "
      "parallel.virtual_pipeline_model_parallel_size (2) = 4", "set model.num_layers=4"]),
    ("virtual-stages-microbatches", "2", ["parallel=pp2", "parallel.virtual_pipeline_model_parallel_size=2",
                                          "model.num_layers=4", "train.global_batch_size=3"],
     ["train.global_batch_size (3) gives 3 micro-batches per data-parallel rank", "set train.global_batch_size=4"]),
]


@pytest.mark.parametrize("world_size,overrides,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_entry_refuses_before_building(world_size, overrides, fragments, tmp_path, monkeypatch, capsys):
    from megatron_pack.cli.train import main

    monkeypatch.setenv("WORLD_SIZE", world_size)
    monkeypatch.setenv("RANK", "0")
    argv = ["experiment=quickstart", f"train.output_dir={tmp_path}/run"] + [o.format(tmp=tmp_path) for o in overrides]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-pack train:")
    for fragment in fragments:
        assert fragment in err, err
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["single_node.sh", "multi_node.sh", "slurm.sbatch"])
def test_launch_scripts_parse(script):
    path = REPO / "launch" / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    text = path.read_text()
    assert "-m megatron_pack.train" in text and '"$@"' in text  # overrides pass through
    assert 'common.sh" "$@"' in text  # one place picks the backend
    assert 'check_config "$' in text  # the config is checked once before torchrun starts
    # relative paths resolve against the caller's folder: no cd, except SLURM's own submission folder
    assert [line for line in text.splitlines() if line.lstrip().startswith("cd ")] == (
        ['cd "${SLURM_SUBMIT_DIR:?is set by SLURM in a job; submit with sbatch}"'] if script == "slurm.sbatch" else [])


@pytest.mark.parametrize("overrides,expected", [
    (["experiment=quickstart"], "parallel.backend=gloo"),  # no GPU here: gloo
    (["experiment=quickstart", "parallel.backend=nccl"], ""),  # an explicit backend wins
], ids=["auto-gloo", "explicit-wins"])
def test_launch_backend_choice(overrides, expected):
    proc = subprocess.run(["bash", "-c", 'source launch/common.sh "$@"; echo "${BACKEND[@]}"', "_", *overrides],
                          cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == expected


@pytest.mark.parametrize("script,args", [("single_node.sh", []), ("multi_node.sh", ["2", "0"])],
                         ids=["single-node", "multi-node"])
def test_launch_scripts_print_usage(script, args):
    proc = subprocess.run(["bash", str(REPO / "launch" / script), *args], capture_output=True, text=True)
    assert proc.returncode != 0 and "usage: launch/" in proc.stderr
