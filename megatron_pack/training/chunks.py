"""The model chunks a rank runs: built, wrapped for bf16 and megatron-core DDP, and unwrapped again.

A rank runs one chunk per pipeline stage it holds: one, or with virtual stages
(``parallel.virtual_pipeline_model_parallel_size`` = VP) VP chunks, chunk ``v`` holding layer block
``v * PP + pp_rank`` (``parallel.pipeline.stage_layout``). Each chunk is a megatron-core ``GPTModel`` (in a
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


def chunk_prefix(index: int, num_chunks: int) -> str:
    """The name prefix that keeps the parameters of several chunks apart in one rank's optimizer and
    checkpoint state (their local names repeat: every chunk has ``decoder.layers.0``): ``""`` for a
    single chunk (the names of PP=1), else ``"chunk<v>."``. Checkpoint files name layers globally
    whatever the prefix (megatron-core's sharded keys), so any layout reads them back."""
    return "" if num_chunks == 1 else f"chunk{index}."


def wrap_ddp(cfg: Config, model: torch.nn.Module, state: ParallelState) -> torch.nn.Module:
    """megatron-core ``DistributedDataParallel`` with ``average_in_collective`` from ``cfg.ddp``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    d = cfg.ddp
    # megatron-core's distributed optimizer (every device) shards DDP's buffers: gradients are reduce-scattered
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=d.grad_reduce_in_fp32, overlap_grad_reduce=d.overlap_grad_reduce,
        use_distributed_optimizer=d.use_distributed_optimizer,
        check_for_nan_in_grad=d.check_for_nan_in_grad, bucket_size=d.bucket_size,
        average_in_collective=d.average_in_collective)
    # the expert groups DDP asks for are in state.pg_collection (initialize_parallel), not megatron's globals
    ddp = DistributedDataParallel(model.config, ddp_config, model, pg_collection=state.pg_collection)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = None  # the trainer calls it itself, after the loss check
    return ddp


def build_model_chunks(cfg: Config, state: ParallelState) -> list[torch.nn.Module]:
    """This rank's DDP-wrapped model chunks in order (``parallel.num_model_chunks`` of them), each seeded
    by ``train.seed``; with ``model.pretrained`` each reads only its own layers' tensors."""
    from megatron_pack.model.builder import build_model

    chunks = []
    for vp_stage in range(cfg.parallel.num_model_chunks):
        model = build_model(cfg, state, vp_stage=vp_stage)
        if cfg.train.bf16:  # megatron-core's bf16 wrapper: casts inputs, keeps fp32 main grads
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(model.config, model)
        chunks.append(model)
    log_parameter_counts(chunks, state)
    wrapped = [wrap_ddp(cfg, chunk, state) for chunk in chunks]
    if len(wrapped) > 1:  # megatron-core's interleaved schedule enters every chunk's no_sync
        wrapped[0].module.config.no_sync_func = [ddp.no_sync for ddp in wrapped]
    return wrapped


def log_parameter_counts(chunks: list[torch.nn.Module], state: ParallelState) -> None:
    """'trainable parameters: X of Y (Z%)' on rank 0 (every TP rank enters the count's all-reduce)."""
    from megatron_pack.model.peft.lora import count_parameters, describe

    pg = state.pg_collection  # experts: every expert-parallel (x expert-TP) rank's own
    counts = [count_parameters(chunk, state.tp_group, getattr(pg, "tp_ep", None), getattr(pg, "ep", None))
              for chunk in chunks]
    trainable, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if state.pp_size > 1:  # every stage's part; a tied embedding's last-stage copy (``shared``) not again
        from megatron_pack.parallel.comm import all_reduce

        shared = [p for chunk in chunks for p in chunk.parameters() if getattr(p, "shared", False)]
        copies = sum(p.numel() * (state.tp_size if getattr(p, "tensor_model_parallel", False) else 1) for p in shared)
        both = torch.tensor([trainable - copies * any(p.requires_grad for p in shared), total - copies],
                            dtype=torch.float64)
        all_reduce(both, group=state.pp_group)
        trainable, total = int(both[0]), int(both[1])
    if state.rank == 0:
        adapters = [getattr(core_model(chunk), "num_adapters", None) for chunk in chunks]
        log.info(describe(trainable, total, None if None in adapters else sum(adapters)))
