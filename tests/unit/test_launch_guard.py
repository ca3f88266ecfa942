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
