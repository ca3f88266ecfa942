"""One step's forward and backward over its micro-batches: megatron-core's schedules, on every device.

Each micro-batch is one THD row (a pack, or micro_batch_size samples packed at collate):
``forward_step`` reads it from the data iterator, keeps this CP rank's slice and returns the
pack's loss SUM; backward runs on that sum (per-token loss), nothing divides by the number of
micro-batches, CP or DP size. :class:`RecordingIterator` remembers the packs handed out, so the
step outcome can count their real tokens and samples.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from megatron_pack.data.batches.vlm import DATA_PROBLEM
from megatron_pack.parallel.groups import ParallelState
from megatron_pack.training.signals import stop_for_data


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
        if DATA_PROBLEM in batch:  # an image changed since prepare: its sample is masked, the run stops after the step
            stop_for_data(batch[DATA_PROBLEM])
        self.packs.append(pack_info(batch))
        self.batches.append(batch)
        return batch

    def take(self) -> tuple[list[PackInfo], list[dict]]:
        packs, batches = self.packs, self.batches
        self.packs, self.batches = [], []
        return packs, batches


def agree_on_microbatches(num_microbatches: int, state: ParallelState) -> None:
    """Every stage of the pipeline plans the same number of micro-batches this step (each reads its own
    loader): one small all-reduce over ``state.pp_group``; a mismatch stops every stage at once instead
    of leaving one waiting for an activation that never comes."""
    from megatron_pack.parallel.comm import all_reduce

    bounds = torch.tensor([num_microbatches, -num_microbatches], dtype=torch.int64)
    all_reduce(bounds, group=state.pp_group, op="max")
    most, least = int(bounds[0]), -int(bounds[1])
    if most != least:
        raise ValueError(f"the pipeline stages planned {least} to {most} micro-batches for this step; every stage of a "
                         "DP rank must read the same packs (the same dataset, plan, train.seed and DP rank).")


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
    """One iterator per model chunk over the same packs (megatron-core's interleaved schedule takes a list):
    every chunk reads each micro-batch's pack for its boundaries; chunk 0 reads the loader, the others
    replay what it read (the loader and the step's pack record see each pack once). Example, 2 chunks
    over packs a, b: chunk 0 yields a, b; chunk 1 then yields a, b."""
    replay = _Replay(iter(data_iterator), num_chunks)
    return [_ChunkIterator(replay, chunk) for chunk in range(num_chunks)]


def forward_backward(*, forward_step_func: Callable, data_iterator: Iterator, model_chunks: list[torch.nn.Module],
                     num_microbatches: int, state: ParallelState, seq_length: int,
                     forward_only: bool = False) -> list[dict]:
    """Run one step's micro-batches over this rank's model chunks with megatron-core's schedule
    (``get_forward_backward_func``: no pipelining, 1F1B, or the interleaved 1F1B with several chunks per
    rank) and its ``P2PCommunicator`` over ``state.pp_group``, on every device (``model.cpu_compat``
    lets it run without CUDA). Returns the loss reports, one per micro-batch on the ranks that hold the
    loss (the last pipeline stage; every rank at PP=1) and none elsewhere.

    ``forward_only`` runs the forwards alone (validation, any number of micro-batches: with virtual stages
    the last group of PP is filled by ``_repeat_last``). ``seq_length`` is the pack size the stages
    exchange when every pack has one shape (``model.builder.fixed_pack_shapes``); otherwise the shapes
    travel with each activation (``config.variable_seq_lengths``). With per-token loss backward runs on
    each micro-batch's loss SUM; the step normalises once (``finalize_model_grads``, called by the loop).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if state.pp_size > 1 and not forward_only:
        agree_on_microbatches(num_microbatches, state)
    if num_microbatches == 0:  # a DP rank without packs (validation); megatron-core's loop would read one
        return []
    config = model_chunks[0].config
    if config.num_moe_experts:
        _reset_moe_loss_scale()
    vp_size = len(model_chunks) if len(model_chunks) > 1 else None
    num_run = num_microbatches
    if vp_size and forward_only and num_microbatches % state.pp_size:
        num_run = -(-num_microbatches // state.pp_size) * state.pp_size
        data_iterator = _repeat_last(data_iterator, num_run - num_microbatches)
    iterators = chunk_iterators(data_iterator, len(model_chunks)) if vp_size else data_iterator
    extra = {}
    if state.pp_size > 1:  # with pg_collection given, megatron-core's pipelined schedules need their communicator
        extra["p2p_communicator"] = stage_communicator(state.pp_group, config)
    reports = get_forward_backward_func(pp_size=state.pp_size, vp_size=vp_size)(
        forward_step_func=forward_step_func, data_iterator=iterators, model=model_chunks,
        num_microbatches=num_run, seq_length=seq_length, micro_batch_size=1, forward_only=forward_only,
        pg_collection=state.pg_collection, **extra)
    return reports[:num_microbatches]


def stage_communicator(pp_group, config):
    """megatron-core's ``P2PCommunicator`` over ``pp_group``, with the shape exchange of variable-length packs
    posted in an order both ends of a link agree on (``_stage_communicator_class``)."""
    return _stage_communicator_class()(pp_group=pp_group, config=config)


@functools.cache
def _stage_communicator_class() -> type:
    """megatron-core 0.16.1's ``_communicate_shapes`` posts send-prev, recv-prev, send-next, recv-next. Point-to-
    point messages between two ranks match in posting order, so where a rank's previous and next stage are the
    same rank (the ring of the interleaved schedule at PP=2) a forward shape and a backward shape exchanged in
    one call cross: rank 0's recv-prev (the forward shape) takes rank 1's send-prev (the gradient's). Here the
    sends go next-then-prev and the receives prev-then-next, so the k-th message from A to B is always the one
    B's k-th receive from A expects; the tensors themselves already travel in a matching order
    (``batch_p2p_comm=False``: megatron-core posts them even/odd). Made once, on first use (megatron-core is
    imported when a step first runs, not when this module is)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_pack.parallel.comm import exchange

    class StageCommunicator(P2PCommunicator):
        def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
            device = torch.cuda.current_device()  # megatron-core's choice (the CPU under model.cpu_compat)
            sends = [(torch.tensor(tensor.size(), dtype=torch.int64, device=device), peer)
                     for tensor, peer in ((tensor_send_next, self.next_rank), (tensor_send_prev, self.prev_rank))
                     if tensor is not None]
            shapes = {name: torch.empty(3, dtype=torch.int64, device=device)
                      for wanted, name in ((recv_prev, "prev"), (recv_next, "next")) if wanted}
            peers = {"prev": self.prev_rank, "next": self.next_rank}
            exchange(sends, [(shapes[name], peers[name]) for name in ("prev", "next") if name in shapes], self.pp_group)
            torch.cuda.synchronize()  # as megatron-core's, against batch_isend_irecv's race
            return tuple(shapes[name].tolist() if name in shapes else [0, 0, 0] for name in ("prev", "next"))

    return StageCommunicator


def _reset_moe_loss_scale() -> None:
    """megatron-core's schedule sets the MoE auxiliary-loss scale (``MoEAuxLossAutoScaler.set_loss_scale``, a
    [1] tensor) by copying into the one the class holds; a MoE backward run outside a schedule first (a
    reference, a test's own step) leaves a [] tensor there, which that copy refuses. The schedule sets the
    scale before any backward of the step, so each step starts from none."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def _repeat_last(data_iterator: Iterator, num_extra: int) -> Iterator:
    """``data_iterator``, then its last item ``num_extra`` more times. megatron-core's interleaved schedule
    runs micro-batches in groups of PP (at least PP of them); validation reads any count, so its last group
    is filled with copies of its last pack, whose reports ``forward_backward`` drops."""
    last = None
    for last in data_iterator:
        yield last
    for _ in range(num_extra):
        yield last
