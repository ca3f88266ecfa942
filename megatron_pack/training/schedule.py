"""One step's forward and backward over its micro-batches: megatron-core's schedule on GPU, the CPU loop otherwise.

Each micro-batch is one THD row (a pack, or micro_batch_size samples packed at collate):
``forward_step`` reads it from the data iterator, keeps this CP rank's slice and returns the
pack's loss SUM; backward runs on that sum (per-token loss), nothing divides by the number of
micro-batches, CP or DP size. :class:`RecordingIterator` remembers the packs handed out, so the
step outcome can count their real tokens and samples.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from megatron_pack.parallel.groups import ParallelState


@dataclass
class PackInfo:
    """What the loop records about each pack it hands to ``forward_step``."""

    sample_ids: list[int]
    real_tokens: int
    slots: int
    bucket: int = 0


def pack_info(batch: dict) -> PackInfo:
    """Sample ids (real samples only), real tokens (``cu_seqlens[-1]``), slots (T) and length bucket of a THD batch."""
    ids = batch["sample_ids"]
    ids = [int(i) for i in (ids.tolist() if torch.is_tensor(ids) else ids) if int(i) >= 0]
    return PackInfo(sample_ids=ids, real_tokens=int(batch["cu_seqlens"][-1]), slots=int(batch["tokens"].shape[-1]),
                    bucket=int(batch.get("bucket", 0)))


class RecordingIterator:
    """Wraps the loader's iterator; remembers every pack handed out since the last ``take()``."""

    def __init__(self, iterable: Iterable[dict]):
        self._it = iter(iterable)
        self._ahead: list[dict] = []
        self.packs: list[PackInfo] = []
        self.batches: list[dict] = []

    def __iter__(self) -> "RecordingIterator":
        return self

    def peek(self, num: int) -> list[dict]:
        """The next ``num`` packs, read ahead (``__next__`` hands them out next, in order): a MoE step
        counts its real tokens from their metadata before the forward (``model.moe.set_step_tokens``)."""
        while len(self._ahead) < num:
            self._ahead.append(next(self._it))
        return self._ahead[:num]

    def __next__(self) -> dict:
        batch = self._ahead.pop(0) if self._ahead else next(self._it)
        self.packs.append(pack_info(batch))
        self.batches.append(batch)
        return batch

    def take(self) -> tuple[list[PackInfo], list[dict]]:
        packs, batches = self.packs, self.batches
        self.packs, self.batches = [], []
        return packs, batches


def forward_backward_cpu(*, forward_step_func: Callable, data_iterator: Iterator, model: torch.nn.Module,
                         num_microbatches: int, per_token_loss: bool = True) -> list[dict]:
    """megatron-core's ``forward_backward_no_pipelining``, without CUDA pieces.

    With ``per_token_loss`` (``model.calculate_per_token_loss``, always with packing) backward runs
    on each micro-batch's loss sum as returned; without it, as megatron-core's schedule does, on
    the sum divided by the micro-batch's target count and by ``num_microbatches``. Gradient sync
    is deferred to the last micro-batch (``no_sync``). Returns the per-micro-batch loss reports.
    """
    reports = []
    for i in range(num_microbatches):
        sync = contextlib.nullcontext() if i == num_microbatches - 1 else model.no_sync()
        with sync:
            output, loss_fn = forward_step_func(data_iterator, model)
            loss_sum, num_tokens, report = loss_fn(output)
            if not per_token_loss:
                loss_sum = loss_sum / torch.clamp(num_tokens, min=1) / num_microbatches
            loss_sum.backward()
        reports.append(report)
    return reports


def agree_on_microbatches(num_microbatches: int, state: ParallelState) -> None:
    """Every stage of the pipeline plans the same number of micro-batches this step (each reads its own
    loader): one small all-reduce over ``state.pp_group``; a mismatch stops every stage at once instead
    of leaving one waiting for an activation that never comes."""
    import torch.distributed as dist

    bounds = torch.tensor([num_microbatches, -num_microbatches], dtype=torch.int64,
                          device=state.device if state.device.type == "cuda" else "cpu")
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=state.pp_group)
    most, least = int(bounds[0]), -int(bounds[1])
    if most != least:
        raise ValueError(f"the pipeline stages planned {least} to {most} micro-batches for this step; every stage of a "
                         "DP rank must read the same packs (the same dataset, plan, train.seed and DP rank).")


def forward_backward(*, forward_step_func: Callable, data_iterator: Iterator, model_chunks: list[torch.nn.Module],
                     num_microbatches: int, state: ParallelState, seq_length: int, link=None) -> list[dict]:
    """Run one step's micro-batches over this rank's model chunks; returns the loss reports, one per
    micro-batch on the ranks that hold the loss (the last pipeline stage; every rank at PP=1) and
    none elsewhere (megatron-core's schedules return an empty list there).

    With pipeline stages (``state.pp_size > 1``): on CPU the 1F1B schedule of ``pipeline_schedule``
    over ``link`` (a ``parallel.pipeline.StageLink``, ``pipeline_schedule.stage_link``); on GPU
    megatron-core's, with its point-to-point communicator over ``state.pp_group``. With several
    chunks per rank (virtual stages) the interleaved 1F1B: on CPU ``interleaved_schedule``'s over a
    ``parallel.pipeline.RingLink``, on GPU megatron-core's; each chunk reads the packs through
    ``interleaved_schedule.chunk_iterators``.
    """
    model = model_chunks[0]
    if state.pp_size > 1:
        agree_on_microbatches(num_microbatches, state)
    if len(model_chunks) > 1:
        return _forward_backward_interleaved(forward_step_func, data_iterator, model_chunks, num_microbatches,
                                             state, seq_length, link)
    if state.device.type != "cuda":
        if state.pp_size > 1:
            from megatron_pack.training.pipeline_schedule import forward_backward_1f1b

            if link is None:
                raise ValueError("forward_backward with pipeline stages needs link (pipeline_schedule.stage_link)")
            reports, _ = forward_backward_1f1b(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                               model=model, num_microbatches=num_microbatches, link=link,
                                               per_token_loss=model.config.calculate_per_token_loss)
            return reports
        return forward_backward_cpu(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                    model=model, num_microbatches=num_microbatches,
                                    per_token_loss=model.config.calculate_per_token_loss)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    extra = {}
    if state.pp_size > 1:  # with pg_collection given, megatron-core's pipelined schedule needs its communicator too
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        extra["p2p_communicator"] = P2PCommunicator(pp_group=state.pp_group, config=model.config)
    return get_forward_backward_func(pp_size=state.pp_size)(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model_chunks,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=1, forward_only=False,
        pg_collection=state.pg_collection, **extra)


def _forward_backward_interleaved(forward_step_func: Callable, data_iterator: Iterator,
                                  model_chunks: list[torch.nn.Module], num_microbatches: int, state: ParallelState,
                                  seq_length: int, link) -> list[dict]:
    """Virtual pipeline stages: the interleaved 1F1B over every chunk (CPU: ours, GPU: megatron-core's)."""
    from megatron_pack.training.interleaved_schedule import chunk_iterators, forward_backward_interleaved

    iterators = chunk_iterators(data_iterator, len(model_chunks))
    config = model_chunks[0].config
    if state.device.type != "cuda":
        if link is None:
            raise ValueError("forward_backward with virtual pipeline stages needs link (pipeline_schedule.stage_link)")
        reports, _ = forward_backward_interleaved(forward_step_func=forward_step_func, data_iterators=iterators,
                                                  model_chunks=model_chunks, num_microbatches=num_microbatches,
                                                  link=link, per_token_loss=config.calculate_per_token_loss)
        return reports
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    return get_forward_backward_func(pp_size=state.pp_size, vp_size=len(model_chunks))(
        forward_step_func=forward_step_func, data_iterator=iterators, model=model_chunks,
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=1, forward_only=False,
        pg_collection=state.pg_collection, p2p_communicator=P2PCommunicator(pp_group=state.pp_group, config=config))
