"""``train.device`` resolved against the host: the one rule for which device a run computes on.

Torch-free, so ``train --check`` and the launch scripts decide before torch starts. The host's answer
(is a GPU visible) is an input, never looked up here: the entry points pass what they probe
(``megatron_pack.config.host.gpu_visible`` before torch, ``torch.cuda.is_available()`` in
``megatron_pack.parallel.groups.initialize_parallel``).

    >>> device_type("auto", gpu_present=True), device_type("cpu", gpu_present=True)
    ('cuda', 'cpu')
    >>> device_problems("cuda", gpu_present=False)[0][:43]
    'train.device (cuda) needs a GPU, but this h'
"""

from __future__ import annotations

def device_type(requested: str, *, gpu_present: bool) -> str:
    """'cuda' or 'cpu': ``auto`` is cuda where a GPU is present; ``cpu`` and ``cuda`` are what they say
    (``cuda`` without a GPU is refused by ``device_problems`` first)."""
    if requested == "auto":
        return "cuda" if gpu_present else "cpu"
    return requested


def backend_for(device: str) -> str:
    """The torch.distributed backend ``parallel.backend=auto`` picks for a compute device type."""
    return "nccl" if device == "cuda" else "gloo"


def device_problems(requested: str, *, gpu_present: bool, backend: str = "auto") -> list[str]:
    """The host rules of ``train.device``: ``cuda`` needs a visible GPU, and ``parallel.backend=nccl`` a run
    that computes on one."""
    if requested == "cuda" and not gpu_present:
        return ["train.device (cuda) needs a GPU, but this host has none visible to torch (no CUDA/ROCm build "
                "of torch, or no GPU device, or CUDA_VISIBLE_DEVICES hides them); set train.device=cpu (or auto), or run "
                "on a GPU host."]
    if backend == "nccl" and device_type(requested, gpu_present=gpu_present) == "cpu":
        return [f"parallel.backend (nccl) needs the run on a GPU, but train.device ({requested}) resolves to the CPU "
                "on this host; set parallel.backend=gloo (or auto)."]
    return []
