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

from megatron_pack.config.schema import ConfigError

def device_type(requested: str, *, gpu_present: bool) -> str:
    """'cuda' or 'cpu': ``auto`` is cuda where a GPU is present; ``cpu`` and ``cuda`` are what they say
    (``cuda`` without a GPU is refused by ``device_problems`` first)."""
    if requested == "auto":
        return "cuda" if gpu_present else "cpu"
    return requested


def backend_for(device: str) -> str:
    """The torch.distributed backend ``parallel.backend=auto`` picks for a compute device type."""
    return "nccl" if device == "cuda" else "gloo"


def run_backend(requested_device: str, requested_backend: str, *, gpu_present: bool) -> tuple[str, str]:
    """(compute device type, torch.distributed backend) of a run: ``parallel.backend`` as set, or for ``auto`` the
    one ``train.device`` resolves to here. The one rule the launch scripts (``cli/launch.py backend``, from the
    loaded config, presets included) and ``ParallelState`` (``parallel.groups.resolve_device``) both follow.

    >>> run_backend("cpu", "auto", gpu_present=True), run_backend("auto", "auto", gpu_present=True)
    (('cpu', 'gloo'), ('cuda', 'nccl'))
    """
    kind = device_type(requested_device, gpu_present=gpu_present)
    return kind, backend_for(kind) if requested_backend in ("auto", None) else requested_backend


def device_index(local_rank: int, num_gpus: int, *, local_world_size: int, share_gpus: bool = False) -> int:
    """The GPU a rank computes on: ``LOCAL_RANK`` modulo the visible GPUs. More ranks on a node than GPUs is refused
    (ranks would share a GPU: NCCL refuses that, and memory is split) unless ``share_gpus`` (a test of exactly that,
    ``MEGATRON_PACK_SHARE_GPUS=1``, as ``tests/gpu/check_trainer.py``'s two ranks on one GPU).

    >>> device_index(1, 2, local_world_size=2), device_index(1, 1, local_world_size=2, share_gpus=True)
    (1, 0)
    """
    if num_gpus < 1:
        raise ValueError("device_index needs at least one visible GPU")
    if local_world_size > num_gpus and not share_gpus:
        raise ConfigError([f"{local_world_size} ranks on this node but {num_gpus} GPU(s) visible: each rank needs its "
                           f"own GPU; start --nproc-per-node {num_gpus} (or fewer), make more GPUs visible "
                           "(CUDA_VISIBLE_DEVICES), or set train.device=cpu."])
    return local_rank % num_gpus


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
