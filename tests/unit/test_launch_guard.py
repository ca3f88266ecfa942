"""The torch-free GPU probe of the launch scripts, and the stop-signal record of a worker."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_pack.config.host import gpu_visible, torch_build_has_gpu

VERSION_PY = """from typing import Optional
__version__ = '2.13.0{tag}'
cuda: Optional[str] = {cuda}
git_version = 'cf30153c'
hip: Optional[str] = {hip}
"""


@pytest.mark.parametrize("cuda,hip,expected", [("None", "None", False), ("'12.4'", "None", True),
                                               ("None", "'6.2.41133'", True)], ids=["cpu", "cuda", "rocm"])
def test_torch_build_from_its_version_file(cuda, hip, expected):
    assert torch_build_has_gpu(VERSION_PY.format(tag="", cuda=cuda, hip=hip)) is expected


def test_probe_agrees_with_torch_here(monkeypatch):
    import torch

    assert gpu_visible() == torch.cuda.is_available()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_visible() is False


def test_a_stop_signal_is_recorded_not_acted_on():
    from megatron_pack.training import signals

    before = signal.getsignal(signal.SIGUSR1)
    try:
        signals.install(["SIGUSR1"])
        assert signals.StopRequest(True, "cpu").agreed() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process with the default action
        assert signals.received() == signal.SIGUSR1
        assert signals.StopRequest(True, "cpu").agreed() == "SIGUSR1"
        assert signals.StopRequest(False, "cpu").agreed() is None  # checkpoint.save_on_signal=false
    finally:
        signal.signal(signal.SIGUSR1, before)
        signals._received.clear()
        signals._installed.discard(signal.SIGUSR1)


def test_a_second_ctrl_c_ends_the_process_at_once():
    """SIGINT is a stop request (recorded, the run saves after its step); a second one ends the process at once,
    with no traceback (the shell sees a run killed by SIGINT)."""
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from megatron_pack.training import signals\n"
            "signals.install(['SIGINT'])\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "assert signals.received() == signal.SIGINT\n"
            "print('recorded', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(5)\n"
            "print('still running', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "recorded\n" and proc.returncode == -signal.SIGINT, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr


# The launch scripts' backend follows the loaded config (a preset's train.device included), by the rule the
# parallel state follows; the overrides' text decides nothing.
BACKEND_CASES = [
    ("gpu-default", [], True, "nccl"),
    ("no-gpu-default", [], False, "gloo"),
    ("gpu-cpu-override", ["train.device=cpu"], True, "gloo"),
    ("gpu-preset-vlm-tiny", ["experiment=vlm_tiny"], True, "gloo"),
    ("gpu-preset-pretrained-tiny", ["experiment=pretrained_tiny"], True, "gloo"),
    ("gpu-preset-then-device-auto", ["experiment=pretrained_tiny", "train.device=auto"], True, "nccl"),
    ("gpu-backend-set", ["parallel.backend=gloo"], True, "gloo"),
    ("gpu-bad-override", ["train.no_such_key=1"], True, "gloo"),
]


@pytest.mark.parametrize("overrides,gpu,expected", [c[1:] for c in BACKEND_CASES], ids=[c[0] for c in BACKEND_CASES])
def test_launch_backend_follows_the_resolved_config(monkeypatch, overrides, gpu, expected):
    from megatron_pack.cli import launch
    from megatron_pack.config.loader import compose_config

    monkeypatch.setattr(launch, "gpu_visible", lambda: gpu)
    assert launch.launch_backend(overrides) == expected
    if overrides[:1] in (["experiment=vlm_tiny"], ["experiment=pretrained_tiny"]):
        # not vacuous: the preset sets the CPU although the command's text never names train.device
        assert compose_config(overrides[:1] + ["model.pretrained=null"]).train.device == "cpu"


def test_launch_backend_and_the_parallel_state_share_one_rule():
    import inspect

    from megatron_pack.cli import launch
    from megatron_pack.parallel import groups

    for module in (launch, groups):
        assert "run_backend(" in inspect.getsource(module), module.__name__


DEVICE_INDEX_CASES = [
    ("rank0-of-1", 0, 1, 1, False, 0),
    ("rank1-of-2-on-2", 1, 2, 2, False, 1),
    ("rank3-of-4-on-8", 3, 8, 4, False, 3),
    ("rank1-of-2-on-1-shared", 1, 1, 2, True, 0),
    ("rank1-of-2-on-1", 1, 1, 2, False, "2 ranks on this node but 1 GPU(s) visible"),
    ("rank5-of-8-on-4", 5, 4, 8, False, "start --nproc-per-node 4"),
]


@pytest.mark.parametrize("local_rank,num_gpus,local_world,share,expected", [c[1:] for c in DEVICE_INDEX_CASES],
                         ids=[c[0] for c in DEVICE_INDEX_CASES])
def test_device_index_is_local_rank_modulo_gpus_or_one_line(local_rank, num_gpus, local_world, share, expected):
    from megatron_pack.config.device import device_index
    from megatron_pack.config.schema import ConfigError

    if isinstance(expected, int):
        assert device_index(local_rank, num_gpus, local_world_size=local_world, share_gpus=share) == expected
        return
    with pytest.raises(ConfigError) as err:
        device_index(local_rank, num_gpus, local_world_size=local_world, share_gpus=share)
    (line,) = err.value.problems
    assert expected in line and "\n" not in line


def test_resolve_device_asks_for_a_visible_gpu(monkeypatch):
    """A second rank on a one-GPU host computes on cuda:0 when sharing is the test, and is refused otherwise."""
    import torch

    from megatron_pack.config.schema import ConfigError
    from megatron_pack.parallel import groups

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv(groups.SHARE_GPUS_ENV, "1")
    assert groups.resolve_device("auto", "gloo") == (torch.device("cuda", 0), "gloo")
    monkeypatch.delenv(groups.SHARE_GPUS_ENV)
    with pytest.raises(ConfigError, match="2 ranks on this node but 1 GPU"):
        groups.resolve_device("auto", "auto")


def test_launch_backend_command_imports_no_torch():
    """The launch scripts ask before torchrun starts: composing the config costs no torch start-up."""
    import subprocess
    import sys

    code = ("import runpy, sys; sys.argv = ['launch', 'backend', 'experiment=vlm_tiny']\n"
            "try:\n    runpy.run_module('megatron_pack.cli.launch', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["gloo", "[]"], out.stdout + out.stderr
