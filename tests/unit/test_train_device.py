"""``train.device`` decided once: the torch-free rule, its resolution in the parallel state, the host
rule refused before launch, and the launch scripts' backend for a CPU run on a GPU host."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_pack.config.device import device_problems, device_type
from megatron_pack.config.schema import ConfigError
from megatron_pack.parallel.groups import resolve_device

# (id, train.device, parallel.backend, GPU present, (device, backend) or a fragment of the refusal)
CASES = [
    ("auto-cpu-host", "auto", "auto", False, ("cpu", "gloo")),
    ("auto-gpu-host", "auto", "auto", True, ("cuda:0", "nccl")),
    ("cuda-gpu-host", "cuda", "auto", True, ("cuda:0", "nccl")),
    ("cpu-cpu-host", "cpu", "auto", False, ("cpu", "gloo")),
    ("gloo-on-gpu", "cuda", "gloo", True, ("cuda:0", "gloo")),
    ("cuda-cpu-host", "cuda", "auto", False, "train.device (cuda) needs a GPU"),
    ("cpu-sees-gpu", "cpu", "auto", True, "CUDA_VISIBLE_DEVICES=''"),
    ("nccl-on-cpu", "cpu", "nccl", False, "parallel.backend (nccl) needs the run on a GPU"),
    ("nccl-auto-cpu-host", "auto", "nccl", False, "parallel.backend (nccl) needs the run on a GPU"),
]


@pytest.mark.parametrize("device,backend,gpu,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_resolve_device(monkeypatch, device, backend, gpu, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(gpu))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            resolve_device(device, backend)
        return
    got, chosen = resolve_device(device, backend)
    assert (str(got), chosen) == expected


@pytest.mark.parametrize("requested,gpu,expected", [("auto", False, "cpu"), ("auto", True, "cuda"),
                                                    ("cpu", True, "cpu"), ("cuda", True, "cuda")],
                         ids=["auto-cpu", "auto-gpu", "cpu-on-gpu", "cuda"])
def test_device_type(requested, gpu, expected):
    assert device_type(requested, gpu_present=gpu) == expected
    assert device_problems(requested, gpu_present=gpu) == []


def test_cuda_on_a_cpu_host_is_refused_by_train(tmp_path):
    """The user's path: ``megatron-pack train train.device=cuda`` on a host without a GPU says so in one problem line
    and exits 2, before any process group (CUDA_VISIBLE_DEVICES='' makes any host one without). (``train --check``
    alone checks such a config for the GPU host it names; the launch scripts' check is for this host:
    tests/unit/test_user_refusals.py.)"""
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "megatron_pack.train", "model=tiny", "train.device=cuda",
                           f"train.output_dir={tmp_path}/run", f"data.dataset_dir={tmp_path}/none"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "train.device" in line]  # under the problem-list header
    assert len(lines) == 1 and "train.device (cuda) needs a GPU" in lines[0] and "set train.device=cpu" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("gpu,overrides,expected", [
    (True, [], "nccl"), (True, ["train.device=cpu"], "gloo"), (False, [], "gloo"), (True, ["train.device=cuda"], "nccl"),
], ids=["gpu", "cpu-run-on-gpu-host", "cpu-host", "cuda"])
def test_launch_backend_follows_train_device(monkeypatch, gpu, overrides, expected):
    from megatron_pack.cli import launch

    monkeypatch.setattr(launch, "gpu_visible", lambda: gpu)
    assert launch.launch_backend(overrides) == expected


def test_a_cpu_run_hides_the_gpus(monkeypatch):
    from megatron_pack.cli.launch import hide_gpus_for_cpu_run

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    hide_gpus_for_cpu_run("auto")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    hide_gpus_for_cpu_run("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
