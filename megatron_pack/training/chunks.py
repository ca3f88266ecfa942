"""The model chunks a rank runs: built, wrapped for bf16 and megatron-core DDP, and unwrapped again.

A rank runs one chunk per pipeline stage it holds (one today: ``parallel.pipeline_model_parallel_size``
is 1; with virtual stages it would hold several). Each chunk is a megatron-core ``GPTModel`` (in a
``Float16Module`` with ``train.bf16``) inside its own ``DistributedDataParallel``; :func:`core_model`
is the one way back from a wrapper to the ``GPTModel`` (checkpoints, the finite-weights check and
``forward_step`` read parameter names and the process groups there).
"""

from __future__ import annotations

import logging

import torch

from megatron_pack.config.schema import Config
from megatron_pack.parallel.groups import ParallelState

log = logging.getLogger("megatron_pack.train")


def core_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron-core wrappers (DDP, Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def only_chunk(model_chunks: list[torch.nn.Module], what: str) -> torch.nn.Module:
    """The one model chunk of this rank (one per pipeline stage); ``what`` names the code that needs it.

    Several chunks per rank would be virtual (interleaved) pipeline stages, which no key enables yet.
    """
    if len(model_chunks) != 1:
        raise NotImplementedError(f"{what} one model chunk per rank (virtual pipeline stages are not built)")
    return model_chunks[0]


def wrap_ddp(cfg: Config, model: torch.nn.Module, state: ParallelState) -> torch.nn.Module:
    """megatron-core ``DistributedDataParallel`` with ``average_in_collective`` from ``cfg.ddp``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    d = cfg.ddp
    # On CPU the distributed optimizer is ours (optim.ShardedTrainOptimizer): it shards the AdamW
    # state over its own flat layout and needs the whole all-reduced gradient, so DDP all-reduces.
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=d.grad_reduce_in_fp32, overlap_grad_reduce=d.overlap_grad_reduce,
        use_distributed_optimizer=d.use_distributed_optimizer and state.device.type == "cuda",
        check_for_nan_in_grad=d.check_for_nan_in_grad, bucket_size=d.bucket_size,
        average_in_collective=d.average_in_collective)
    # the expert groups DDP asks for are in state.pg_collection (initialize_parallel), not megatron's globals
    ddp = DistributedDataParallel(model.config, ddp_config, model, pg_collection=state.pg_collection)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = None  # the trainer calls it itself, after the loss check
    return ddp


def build_model_chunks(cfg: Config, state: ParallelState) -> list[torch.nn.Module]:
    """This rank's DDP-wrapped model chunks, seeded by ``train.seed`` (one: pipeline stages are one chunk each)."""
    from megatron_pack.model.builder import build_model

    model = build_model(cfg, state)
    if cfg.train.bf16:  # megatron-core's bf16 wrapper: casts inputs, keeps fp32 main grads
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    chunks = [model]
    log_parameter_counts(chunks, state)
    return [wrap_ddp(cfg, chunk, state) for chunk in chunks]


def log_parameter_counts(chunks: list[torch.nn.Module], state: ParallelState) -> None:
    """'trainable parameters: X of Y (Z%)' on rank 0 (every TP rank enters the count's all-reduce)."""
    from megatron_pack.model.peft.lora import count_parameters, describe

    counts = [count_parameters(chunk, state.tp_group) for chunk in chunks]
    trainable, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if state.pp_size > 1:  # every stage's part; a tied embedding's last-stage copy (``shared``) not again
        import torch.distributed as dist

        shared = [p for chunk in chunks for p in chunk.parameters() if getattr(p, "shared", False)]
        copies = sum(p.numel() * (state.tp_size if getattr(p, "tensor_model_parallel", False) else 1) for p in shared)
        both = torch.tensor([trainable - copies * any(p.requires_grad for p in shared), total - copies],
                            dtype=torch.float64)
        dist.all_reduce(both, group=state.pp_group)
        trainable, total = int(both[0]), int(both[1])
    if state.rank == 0:
        adapters = [getattr(core_model(chunk), "num_adapters", None) for chunk in chunks]
        log.info(describe(trainable, total, None if None in adapters else sum(adapters)))
