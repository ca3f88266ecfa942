"""Process-group setup: the one place that touches megatron-core's ``parallel_state`` globals.

``initialize_parallel`` starts ``torch.distributed`` (from the torchrun environment when it is
not started yet; gloo without CUDA), asks megatron-core to build its TP / CP / DP groups once,
and returns a ``ParallelState`` holding every group and rank the rest of the package needs.
Everything downstream takes that object (or its ``pg_collection``) instead of reading
megatron's module globals, so a test can build several worlds one after another in the same
processes: ``destroy_parallel()`` tears the groups down again.

Example (2 processes launched by torchrun, CPU)::

    state = initialize_parallel(cfg.parallel)        # tp=1, cp=2
    state.cp_size, state.cp_rank, state.dp_size      # (2, <0 or 1>, 1)
    model = build_model(cfg, state)
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_pack.config.device import device_index, device_problems, device_type, run_backend
from megatron_pack.config.schema import Config, ConfigError, ParallelConfig
from megatron_pack.config.validate import validate_parallel
from megatron_pack.parallel.comm import all_gather, all_gather_object, device_for_backend
from megatron_pack.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class ParallelState:
    """The parallel layout of this run and this process's place in it: one object, built once.

    ``dims`` holds the degrees (``ParallelDims``: world = dp x cp x tp x pp, the pad multiple,
    sequence parallelism, ``describe()``), the same object ``megatron-pack train`` describes before
    groups start; the sizes below read it, so each degree has one home. The rest is what only
    exists once ``torch.distributed`` runs: this process's ranks and its process groups, expert
    groups included (``pg_collection.ep`` / ``.expt_dp``, for megatron-core's DDP).
    """

    dims: ParallelDims
    """Degrees of the run (the sizes below are read from here)."""
    rank: int
    """Global rank."""
    backend: str
    """torch.distributed backend in use ('gloo' or 'nccl')."""
    device: torch.device
    """Compute device: where the model and its batches live (``train.device``, resolved once here)."""
    comm_device: torch.device
    """Where the backend's collectives take tensors (nccl: the GPU, gloo: the CPU); ``parallel.comm`` moves
    tensors there, so a call site needs neither this nor the backend."""
    tp_rank: int
    """Rank inside the tensor-parallel group."""
    cp_rank: int
    """Rank inside the context-parallel group."""
    dp_rank: int
    """Rank inside the data-parallel group."""
    pp_rank: int
    """Rank inside the pipeline-parallel group: the stage this rank runs (0 at PP=1)."""
    tp_group: dist.ProcessGroup
    """Tensor-parallel process group."""
    cp_group: dist.ProcessGroup
    """Context-parallel process group."""
    dp_group: dist.ProcessGroup
    """Data-parallel process group (without CP)."""
    pp_group: dist.ProcessGroup
    """Pipeline-parallel process group: the ranks of every stage of this rank's pipeline (this rank alone at PP=1)."""
    dp_cp_group: dist.ProcessGroup
    """Data x context-parallel group: gradients and token counts are summed over it."""
    pg_collection: "ProcessGroupCollection"
    """megatron-core ``ProcessGroupCollection`` with the same groups plus the expert groups (for
    megatron modules, DDP and ``finalize_model_grads``); nothing reads megatron's globals for them."""

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return self.dims.world_size

    @property
    def tp_size(self) -> int:
        """Tensor-parallel degree."""
        return self.dims.tp

    @property
    def cp_size(self) -> int:
        """Context-parallel degree."""
        return self.dims.cp

    @property
    def dp_size(self) -> int:
        """Data-parallel degree (without CP)."""
        return self.dims.dp

    @property
    def pp_size(self) -> int:
        """Pipeline-parallel degree (stages)."""
        return self.dims.pp

    @property
    def is_first_stage(self) -> bool:
        """This rank runs the first pipeline stage (the embedding; reads the tokens)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank runs the last pipeline stage (the output layer; computes the loss)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def ep_rank(self) -> int:
        """Rank inside the expert-parallel group (0 without expert parallelism)."""
        return self.pg_collection.ep.rank()

    @property
    def etp_rank(self) -> int:
        """Rank inside the expert tensor-parallel group."""
        return self.pg_collection.expt_tp.rank()


SHARE_GPUS_ENV = "MEGATRON_PACK_SHARE_GPUS"
"""Set to 1 by a test that runs more ranks than GPUs on purpose (``tests/gpu/check_trainer.py``: two gloo ranks on
one GPU); anything else refuses such a layout (``config.device.device_index``)."""

_MEGATRON_GROUPS = ("tp", "pp", "mp", "cp", "tp_cp", "dp", "dp_cp", "intra_dp_cp", "tp_dp_cp", "embd", "pos_embd",
                    "ep", "expt_tp", "tp_ep", "tp_ep_pp", "expt_dp", "intra_expt_dp", "intra_dist_opt")
"""Groups put into ``ParallelState.pg_collection`` (everything megatron-core's GPTModel, DDP and
``finalize_model_grads`` ask for; the expert groups ``ep`` / ``expt_dp`` are trivial without MoE but
DDP requires them, so they come from here rather than from megatron's globals)."""


def resolve_device(requested_device: str, requested_backend: Optional[str]) -> tuple[torch.device, str]:
    """(compute device, torch.distributed backend) of this process: the one place that asks torch whether
    CUDA is present. ``train.device=auto`` picks the GPU where CUDA is present; the backend ``auto``
    follows the device (nccl on a GPU, gloo on the CPU): ``config.device.run_backend``, the rule the launch
    scripts follow too. The GPU is ``LOCAL_RANK`` modulo the visible GPUs; more ranks on a node than GPUs is
    refused in one line (``config.device.device_index``) unless ``MEGATRON_PACK_SHARE_GPUS=1`` (a test of exactly
    that: two gloo ranks on one GPU).

    ``train.device=cpu`` on a host with CUDA needs a process that does not see the GPU: megatron-core
    places its own tensors (RoPE frequencies, TP buffers) on ``torch.cuda.current_device()``.
    ``megatron-pack train`` and ``verify`` hide the GPUs before torch starts CUDA
    (``megatron_pack.cli.launch.hide_gpus_for_cpu_run``); a Python caller does the same.
    """
    cuda = torch.cuda.is_available()
    backend = requested_backend or "auto"
    problems = device_problems(requested_device, gpu_present=cuda, backend=backend)
    if problems:
        raise ConfigError(problems)
    if device_type(requested_device, gpu_present=cuda) == "cpu" and cuda:
        raise ConfigError(["train.device (cpu) in a process that sees a GPU: megatron-core would put its own "
                           "tensors on the GPU; start the process with CUDA_VISIBLE_DEVICES='' (megatron-pack "
                           "train and verify do this for train.device=cpu)."])
    kind, backend = run_backend(requested_device, backend, gpu_present=cuda)
    if kind != "cuda":
        return torch.device("cpu"), backend
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = device_index(local_rank, torch.cuda.device_count(),
                         local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1))),
                         share_gpus=os.environ.get(SHARE_GPUS_ENV) == "1")
    return torch.device("cuda", index), backend


def _init_process_group(backend: str, device: torch.device) -> None:
    """Start torch.distributed from the torchrun env, or as a private world of one without it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(minutes=30)
    if "RANK" not in os.environ:
        # A single process (verify, a notebook, a unit test): no env vars are set or needed.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    # torchrun's agent keeps its store across restarts (--max-restarts): keys left by the killed
    # attempt's groups make this attempt's gloo rendezvous wait forever on dead peers, so every
    # attempt rendezvouses under its own prefix.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"megatron_pack/attempt_{attempt}", store),
                            rank=rank, world_size=world_size, timeout=timeout)


def _parallel_config(cfg_or_parallel_cfg: Config | ParallelConfig) -> ParallelConfig:
    if isinstance(cfg_or_parallel_cfg, ParallelConfig):
        return cfg_or_parallel_cfg
    return cfg_or_parallel_cfg.parallel


def _launched_world_size() -> int:
    """The world size this process will join, known before any process group starts."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def initialize_parallel(cfg_or_parallel_cfg: Config | ParallelConfig, *, backend: Optional[str] = None,
                        device: Optional[str] = None) -> ParallelState:
    """Start torch.distributed and megatron-core's model-parallel groups once; return them.

    ``backend`` overrides ``parallel.backend`` ('auto' follows the device: nccl on a GPU, else gloo);
    ``device`` overrides ``train.device`` ('auto' when only ``parallel.*`` is given). Both are resolved
    once here (``resolve_device``) into ``ParallelState.device`` and ``.comm_device``. Without
    CUDA the entry point turns on ``megatron_pack.model.cpu_compat`` itself (this layer does not
    import the model layer); ``build_model`` does it too, so a model is never built without it.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    pcfg = _parallel_config(cfg_or_parallel_cfg)
    if device is None:
        device = cfg_or_parallel_cfg.train.device if isinstance(cfg_or_parallel_cfg, Config) else "auto"
    compute_device, chosen = resolve_device(device, backend if backend is not None else pcfg.backend)
    validate_parallel(pcfg, world_size=_launched_world_size())  # ConfigError before any group starts
    _init_process_group(chosen, compute_device)
    pad_seq_to_mult = cfg_or_parallel_cfg.packing.pad_seq_to_mult if isinstance(cfg_or_parallel_cfg, Config) else None
    dims = ParallelDims.from_parallel_config(pcfg, dist.get_world_size(), pad_seq_to_mult=pad_seq_to_mult)
    if mpu.model_parallel_is_initialized():
        raise RuntimeError("megatron-core model-parallel groups are already initialised; call "
                           "megatron_pack.parallel.groups.destroy_parallel() before initialising again.")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=pcfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=pcfg.pipeline_model_parallel_size,
        context_parallel_size=pcfg.context_parallel_size,
        expert_model_parallel_size=pcfg.expert_model_parallel_size,
        expert_tensor_parallel_size=pcfg.expert_tensor_parallel_size,
        create_gloo_process_groups=False,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(_MEGATRON_GROUPS))
    sizes = {"tp": (pgs.tp.size(), dims.tp), "cp": (pgs.cp.size(), dims.cp), "dp": (pgs.dp.size(), dims.dp),
             "pp": (pgs.pp.size(), dims.pp), "ep": (pgs.ep.size(), dims.ep),
             "expt_tp": (pgs.expt_tp.size(), dims.expert_tp)}
    assert all(got == want for got, want in sizes.values()), f"megatron-core built other groups than {dims}: {sizes}"
    return ParallelState(
        dims=dims, rank=dist.get_rank(), backend=dist.get_backend(), device=compute_device,
        comm_device=device_for_backend(dist.get_backend()),
        tp_rank=pgs.tp.rank(), cp_rank=pgs.cp.rank(), dp_rank=pgs.dp.rank(), pp_rank=pgs.pp.rank(),
        tp_group=pgs.tp, cp_group=pgs.cp, dp_group=pgs.dp, pp_group=pgs.pp, dp_cp_group=pgs.dp_cp,
        pg_collection=pgs,
    )


def gather_objects(group: dist.ProcessGroup) -> Callable[[Any], list]:
    """``gather(obj)``: every rank of ``group``'s ``obj`` (picklable), by group rank; every rank of the
    group must call it, in the same order (an all-gather).

    >>> gather = gather_objects(state.dp_group)   # doctest: +SKIP
    >>> gather([3, 5])                            # on DP rank 0 of 2; rank 1 passed [4]   # doctest: +SKIP
    [[3, 5], [4]]
    """

    def gather(obj: Any) -> list:
        return all_gather_object(obj, group=group)

    return gather


_AT_TEARDOWN: list = []
"""Callbacks of ``at_teardown``, run (and forgotten) by the next ``destroy_parallel``."""


def at_teardown(callback) -> None:
    """Have the next ``destroy_parallel`` call ``callback()`` before it destroys the groups: what an object made for
    the layout needs undone to be freed at all (``model.moe.attach_pack_routing``). The callback must not hold that
    object strongly (a ``weakref``)."""
    _AT_TEARDOWN.append(callback)


def destroy_parallel(*, destroy_process_group: bool = False) -> None:
    """Tear down megatron-core's groups and every other group made for the layout (and, when asked,
    torch.distributed itself).

    The groups are destroyed, not only forgotten: torch.distributed keeps every group it made until it is
    destroyed, and each live gloo group keeps 3 threads that wake while idle (about 1 ms of CPU a second each). A
    process that builds several layouts one after another (``_train_cases``, ``verify`` inside a caller's
    process group, the layout tests) carried hundreds of them: 975 threads a rank in one test world, a third of a
    core each. Garbage is collected after, so the groups a model, its DDP buffers or optimizer held in reference
    cycles end with them; teardown callbacks (``at_teardown``) run first, and megatron-core's rotary cache, which held
    each layout's CP group, is emptied. The default group stays unless ``destroy_process_group``."""
    import gc

    from megatron.core import parallel_state as mpu

    callbacks, _AT_TEARDOWN[:] = list(_AT_TEARDOWN), []
    for callback in callbacks:
        callback()
    _clear_rotary_caches()
    if dist.is_initialized():
        for group in _layout_groups():
            dist.destroy_process_group(group)
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


_ROTARY_MODULES = {"megatron.core.models.common.embeddings.rotary_pos_embedding": "RotaryEmbedding",
                   "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": "YarnRotaryEmbedding"}
"""megatron-core's rotary embeddings whose ``forward`` is an ``lru_cache`` (32 entries, class-wide)."""


def _clear_rotary_caches() -> None:
    """Empty megatron-core's class-wide cache of rotary ``forward`` calls: each entry holds the rotary module and
    the CP group it was called with, so without this every layout's CP group (3 idle-waking gloo threads) and
    rotary table outlived it, up to 32 of them. Only the modules already imported (a model was built)."""
    import sys

    for module_name, class_name in _ROTARY_MODULES.items():
        forward = getattr(getattr(sys.modules.get(module_name), class_name, None), "forward", None)
        if hasattr(forward, "cache_clear"):
            forward.cache_clear()


def _layout_groups() -> list:
    """Every process group of this process but the default one (torch's registry of the groups it made)."""
    from torch.distributed import distributed_c10d as c10d

    registry = getattr(getattr(c10d, "_world", None), "pg_map", {})
    return [group for group in list(registry) if group is not c10d.GroupMember.WORLD]


def gather_full_logits(logits: torch.Tensor, cu_seqlens_padded, state: ParallelState) -> torch.Tensor:
    """The whole pack's logits [1, T, V_padded] from this rank's [1, T/CP, V/TP] slice.

    All-gathers the vocabulary shards over TP (concatenated in rank order) and the token slices
    over CP (put back at their global positions by ``thd_unslice``). Every rank of the TP and CP
    groups must call it. Used by ``verify`` and by the parallel-equivalence tests.
    """
    from megatron_pack.parallel.cp import thd_unslice

    logits = logits.detach().contiguous()
    if state.tp_size > 1:
        logits = torch.cat(all_gather(logits, group=state.tp_group), dim=-1)
    if state.cp_size > 1:
        logits = thd_unslice(all_gather(logits, group=state.cp_group), cu_seqlens_padded, dim=1)
    return logits
