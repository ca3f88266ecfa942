"""``train.deterministic`` does something on CPU: torch's deterministic algorithms and the seeds; on a GPU the
cuBLAS workspace setting, refused when the environment sets a nondeterministic one."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megatron_pack.config.schema import ConfigError
from megatron_pack.training.determinism import apply_determinism


@pytest.fixture(autouse=True)
def _restore_torch_defaults():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


@pytest.mark.parametrize("deterministic", [True, False], ids=["on", "off"])
def test_deterministic_sets_torch_and_the_seeds_on_cpu(deterministic):
    torch.use_deterministic_algorithms(False)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    unseeded = _draws()
    apply_determinism(deterministic, 1234, torch.device("cpu"))
    after = _draws()
    assert torch.are_deterministic_algorithms_enabled() is deterministic
    if deterministic:
        random.seed(1234), np.random.seed(1234), torch.manual_seed(1234)
        assert after == _draws() and after != unseeded  # the run's seed, not whatever came before
    else:
        assert after != unseeded  # untouched: the generators just went on


def test_uninitialized_memory_is_filled_under_it():
    """Visible on CPU: with deterministic algorithms torch fills new uninitialized tensors (NaN), so a read of
    memory nothing wrote cannot differ between two runs."""
    apply_determinism(True, 0, torch.device("cpu"))
    assert bool(torch.isnan(torch.empty(64)).all())


@pytest.mark.parametrize("env,expected", [(None, ":4096:8"), (":16:8", ":16:8"), (":0:0", "refused")],
                         ids=["unset", "other-deterministic", "nondeterministic"])
def test_gpu_sets_the_cublas_workspace(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", env)
    gpu = torch.device("cuda", 0)  # only the device's type is read: no GPU needed
    if expected == "refused":
        with pytest.raises(ConfigError, match=r"train.deterministic \(True\) on a GPU needs CUBLAS_WORKSPACE_CONFIG"):
            apply_determinism(True, 0, gpu)
        return
    apply_determinism(True, 0, gpu)
    import os

    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == expected
    assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False
