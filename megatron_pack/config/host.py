"""What this machine can run, found without importing torch (the launch scripts and ``train --check`` stay fast).

The host is one of the inputs a validation rule may need (``config/validate.py``): ``train``, ``train --check``,
``verify`` and the launch scripts probe it once, before any process group starts, so a setting this machine
cannot run (``model.fp8`` or CUDA graphs without a GPU, ``parallel.backend=nccl`` on a CPU host) is refused
there, in one line, and never inside torchrun.

    >>> Host(gpu=False, transformer_engine=False).device("auto")
    'cpu'
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_pack.config.device import device_type


def torch_build_has_gpu(version_py: Optional[str] = None) -> bool:
    """torch was built with CUDA or ROCm: ``cuda`` or ``hip`` set in ``torch/version.py`` (its text, or
    the installed torch's, read without importing torch). Example: ``cuda: Optional[str] = '12.4'``."""
    if version_py is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.origin is None:
            return False
        version_py = (Path(spec.origin).parent / "version.py").read_text(encoding="utf-8")
    return any(re.search(rf"^{key}\b[^=\n]*=\s*'[^']+'", version_py, re.M) for key in ("cuda", "hip"))


OPTIONAL_PACKAGES = ("wandb", "mlflow")
"""Modules a setting may need that the package does not install (``logging.wandb``, ``logging.mlflow``)."""


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` from its metadata (nothing imported); None when not installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_visible() -> bool:
    """What ``torch.cuda.is_available()`` would say, from the build and the device nodes (no torch import)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    has_device = any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()
    return has_device and torch_build_has_gpu()


@dataclass(frozen=True, kw_only=True)
class Host:
    """The machine a command runs on, as the rules that need it see it."""

    gpu: bool
    """torch would see a CUDA (or ROCm) device here."""
    transformer_engine: bool
    """Transformer Engine is installed (its FP8 GEMMs, fused attention and CUDA-graph support)."""
    transformer_engine_version: Optional[str] = None
    """Its installed version (from the package metadata, not imported); None where unknown."""
    nvte_allow_nondeterministic: Optional[str] = None
    """The environment's NVTE_ALLOW_NONDETERMINISTIC_ALGO (train.deterministic with Transformer Engine needs 0)."""
    packages: Optional[frozenset[str]] = None
    """The ``OPTIONAL_PACKAGES`` installed here (found, not imported); None where unknown (no rule then refuses)."""
    checks_declared_gpu: bool = False
    """``train --check`` and ``--cfg job``: a config that names ``train.device=cuda`` is checked for the GPU host it
    names (with Transformer Engine) when this host has no GPU, so a cluster's config can be checked on a laptop; a
    run (``train``, ``verify``) is always checked for this host."""

    @classmethod
    def probe(cls, *, checks_declared_gpu: bool = False) -> "Host":
        """This machine, without importing torch or Transformer Engine."""
        return cls(gpu=gpu_visible(), transformer_engine=importlib.util.find_spec("transformer_engine") is not None,
                   transformer_engine_version=installed_version("transformer_engine"),
                   nvte_allow_nondeterministic=os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO"),
                   packages=frozenset(m for m in OPTIONAL_PACKAGES if importlib.util.find_spec(m) is not None),
                   checks_declared_gpu=checks_declared_gpu)

    def for_device(self, requested: str) -> "Host":
        """The host the rules check a config of ``train.device=requested`` for (see ``checks_declared_gpu``)."""
        if self.checks_declared_gpu and requested == "cuda" and not self.gpu:
            return Host(gpu=True, transformer_engine=True, packages=self.packages)
        return self

    def device(self, requested: str) -> str:
        """``train.device`` as a run here resolves it: 'auto' is cuda with a GPU, else cpu."""
        return device_type(requested, gpu_present=self.gpu)

    def describe(self, requested: str) -> str:
        """How the device was chosen, for a message: ``train.device=cpu`` or ``train.device=auto finds no GPU here``."""
        if requested == "auto":
            return "train.device=auto finds " + ("a GPU here" if self.gpu else "no GPU on this host")
        return f"train.device={requested}"
