"""``train.deterministic``: what makes a run repeat itself, set once before the model is built.

- torch's deterministic algorithms (``torch.use_deterministic_algorithms(True)``): an op without a
  deterministic implementation raises instead of silently varying;
- the seeds of python's ``random``, numpy and torch (``train.seed``; megatron-core's named streams are
  seeded by ``build_model``);
- on a GPU: cuDNN's deterministic kernels without autotuning, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
  (cuBLAS is deterministic only with a fixed workspace; set before the first cuBLAS call). An environment
  that sets another value is refused: the run could not be deterministic. Transformer Engine's attention
  has its own switch (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, ``model/builder.py``).

``train.deterministic=false`` leaves torch's defaults alone.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from megatron_pack.config.schema import ConfigError

CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
"""The cuBLAS workspace settings under which cuBLAS is deterministic (the first is set when none is)."""


def apply_determinism(deterministic: bool, seed: int, device: torch.device) -> None:
    """Set what ``train.deterministic`` promises for a run computing on ``device`` (module docstring);
    raises ``ConfigError`` where it cannot hold."""
    if not deterministic:
        return
    if device.type == "cuda":
        current = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC[0])
        if current not in CUBLAS_DETERMINISTIC:
            raise ConfigError([f"train.deterministic (True) on a GPU needs CUBLAS_WORKSPACE_CONFIG="
                               f"{CUBLAS_DETERMINISTIC[0]} (or {CUBLAS_DETERMINISTIC[1]}), but the environment sets it "
                               f"to {current!r}; unset it or set train.deterministic=false."])
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
