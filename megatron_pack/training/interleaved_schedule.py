"""Virtual pipeline stages: megatron-core's interleaved 1F1B schedule on CPU, over ``RingLink`` (gloo).

With ``parallel.virtual_pipeline_model_parallel_size`` = VP each of the PP ranks runs VP model
chunks. On GPU the schedule is megatron-core's ``forward_backward_pipelining_with_interleaving``;
its 0.16.1 code creates CUDA tensors, so on CPU :func:`forward_backward_interleaved` runs the same
order with the same numerics:

* the M micro-batches go in groups of PP (megatron-core's ``microbatch_group_size_per_vp_stage``
  default): virtual micro-batch ``k`` is micro-batch ``schedule_table(M, VP, PP)[k]`` of chunk
  ``(k // PP) % VP`` (:func:`schedule_table`); M must be a multiple of PP (``validate()``);
* rank ``r`` runs ``min((PP - r - 1) * 2 + (VP - 1) * PP, M * VP)`` warm-up forwards, then one
  forward and one backward at a time, then the cool-down backwards; backward ``k`` runs chunk
  ``VP - 1 - chunk(k)``, its micro-batches in the order that chunk ran them forward;
* the last chunk of the last rank applies the loss function (per-token loss: backward on the loss
  SUM; without it on sum / target count / M, as megatron-core does) and counts the target tokens,
  which ``finalize_model_grads(chunks, num_tokens=...)`` then spreads over the pipeline and DP x CP;
* each chunk's gradient sync waits for its last backward (``no_sync`` until then).

Every chunk reads each micro-batch's pack for its boundaries: :func:`chunk_iterators` hands chunk 0
the loader's packs and replays them to the other chunks (the loader and the step's pack record see
each pack once).

Example (CPU, rank r of PP=2 with VP=2 chunks, 4 micro-batches)::

    link = RingLink(state.pp_group, num_chunks=2)
    reports, num_tokens = forward_backward_interleaved(forward_step_func=forward_step,
                                                       data_iterators=chunk_iterators(it, 2),
                                                       model_chunks=chunks, num_microbatches=4, link=link)
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Iterator

import torch

from megatron_pack.parallel.pipeline import RingLink
from megatron_pack.training.pipeline_schedule import StageRun

__all__ = ["chunk_iterators", "forward_backward_interleaved", "schedule_table", "warmup_count"]


def schedule_table(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of every virtual micro-batch, in forward order (megatron-core's
    ``get_schedule_table``). Example, M=4, VP=2, groups of 2:
    ``[(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]``."""
    table = []
    for first in range(0, num_microbatches, group_size):
        last = num_microbatches if first + group_size >= num_microbatches else first + group_size
        table += [(mb, chunk) for chunk in range(num_chunks) for mb in range(first, last)]
    return table


def warmup_count(pp_size: int, pp_rank: int, num_chunks: int, num_microbatches: int) -> int:
    """Warm-up forwards of rank ``pp_rank`` (megatron-core's ``get_pp_rank_microbatches``)."""
    return min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, num_microbatches * num_chunks)


class _Replay:
    """One data iterator per chunk: chunk 0 reads the source, the others replay what it read, in order."""

    def __init__(self, source: Iterator, num_chunks: int):
        self.source = source
        self.queues = [deque() for _ in range(num_chunks)]

    def next_for(self, chunk: int):
        if chunk == 0:
            batch = next(self.source)
            for queue in self.queues[1:]:
                queue.append(batch)
            return batch
        if not self.queues[chunk]:
            raise RuntimeError(f"model chunk {chunk} asked for a micro-batch before chunk 0 read it (schedule bug)")
        return self.queues[chunk].popleft()


class _ChunkIterator:
    def __init__(self, replay: _Replay, chunk: int):
        self.replay, self.chunk = replay, chunk

    def __iter__(self):
        return self

    def __next__(self):
        return self.replay.next_for(self.chunk)


def chunk_iterators(data_iterator: Iterator, num_chunks: int) -> list[Iterator]:
    """One iterator per model chunk over the same packs (megatron-core's interleaved schedule takes a list)."""
    replay = _Replay(iter(data_iterator), num_chunks)
    return [_ChunkIterator(replay, chunk) for chunk in range(num_chunks)]


def forward_backward_interleaved(*, forward_step_func: Callable, data_iterators: list[Iterator], model_chunks: list,
                                 num_microbatches: int, link: RingLink, per_token_loss: bool = True,
                                 forward_only: bool = False) -> tuple[list[dict], torch.Tensor]:
    """Run this rank's part of the interleaved 1F1B schedule; returns (loss reports, target tokens), both
    from the rank holding the loss chunk (the other ranks return ``[]`` and a zero count).

    ``forward_only`` runs the forwards alone (validation; any micro-batch count), one micro-batch at a
    time through every chunk, each send waited for before the next receive: nothing is left posted, so
    it also runs over NCCL (GPU validation), whose sends and receives with one peer share a stream.
    """
    num_chunks, pp = len(model_chunks), link.pp_size
    if not forward_only and num_microbatches % pp:
        raise ValueError(f"the interleaved pipeline schedule got {num_microbatches} micro-batches, which must be a "
                         f"multiple of parallel.pipeline_model_parallel_size ({pp}); set train.global_batch_size so "
                         "that every data-parallel rank runs a multiple of it (validate() checks the fixed count).")
    runs = [StageRun(forward_step_func, it, model, num_microbatches, per_token_loss)
            for it, model in zip(data_iterators, model_chunks)]
    if forward_only:
        with torch.no_grad():
            for _ in range(num_microbatches):
                for chunk in range(num_chunks):
                    link.send_forward(runs[chunk].forward(link.recv_forward(chunk)), chunk)
                    link.finish()
        return _totals(runs)
    table = schedule_table(num_microbatches, num_chunks, pp)
    total = len(table)
    syncs = [getattr(m, "no_sync", contextlib.nullcontext)() for m in model_chunks]
    for sync in syncs:
        sync.__enter__()
    pending = [deque() for _ in range(num_chunks)]
    backwards_done = [0] * num_chunks

    def forward(k: int) -> None:
        chunk = table[k][1]
        input_tensor = link.recv_forward(chunk)
        output = runs[chunk].forward(input_tensor)
        link.send_forward(output, chunk)
        pending[chunk].append((input_tensor, output))

    def backward(k: int) -> None:
        chunk = num_chunks - 1 - table[k][1]
        input_tensor, output = pending[chunk].popleft()
        grad = link.recv_backward(output, chunk)
        backwards_done[chunk] += 1
        if backwards_done[chunk] == num_microbatches:  # this chunk's last backward syncs its gradients
            syncs[chunk].__exit__(None, None, None)
        input_grad = StageRun.backward(input_tensor, output, grad)
        if input_grad is not None:
            link.send_backward(input_grad, chunk)

    num_warmup = warmup_count(pp, link.pp_rank, num_chunks, num_microbatches)
    for k in range(num_warmup):
        forward(k)
    for k in range(total - num_warmup):
        forward(num_warmup + k)
        backward(k)
    for k in range(total - num_warmup, total):
        backward(k)
    for chunk in range(num_chunks):
        if backwards_done[chunk] < num_microbatches:  # no micro-batch at all: leave no_sync all the same
            syncs[chunk].__exit__(None, None, None)
    link.finish()
    return _totals(runs)


def _totals(runs: list[StageRun]) -> tuple[list[dict], torch.Tensor]:
    """The loss reports and target tokens (only the chunk with the output layer has any)."""
    return [report for run in runs for report in run.reports], sum(run.num_tokens for run in runs)
