"""megatron-core on a machine without CUDA: the one place that accommodates its device assumptions.

megatron-core 0.16.1 asks ``torch.cuda.current_device()`` for the device of new tensors in many
places (RoPE frequencies, TP collective buffers, the grad buffers of its DDP). Without CUDA that
call raises. ``enable_cpu_compat()`` makes it answer ``"cpu"``, a valid ``device=`` argument,
so those tensors land on the CPU. Nothing else is changed.

It is called only when ``torch.cuda.is_available()`` is False (by
``megatron_pack.parallel.groups.initialize_parallel`` and ``megatron_pack.model.builder``), and
refuses to run when CUDA is present, so the GPU path never goes through it. It is idempotent.
"""

from __future__ import annotations

import torch

_ENABLED = False


def _cpu_current_device() -> str:
    return "cpu"


def enable_cpu_compat() -> None:
    """Make megatron-core's ``torch.cuda.current_device()`` calls answer ``"cpu"`` (CPU-only hosts)."""
    global _ENABLED
    if torch.cuda.is_available():
        raise RuntimeError("enable_cpu_compat() is for hosts without CUDA; the GPU path must not use it.")
    if _ENABLED:
        return
    torch.cuda.current_device = _cpu_current_device
    _ENABLED = True


def cpu_compat_enabled() -> bool:
    """True once ``enable_cpu_compat()`` has run in this process."""
    return _ENABLED
