"""Pipeline stages: which layers a stage holds, and activations between stages with their shapes.

A pipeline of ``pp`` stages splits ``num_layers`` transformer layers evenly: stage ``s`` holds
layers ``[s * n, (s + 1) * n)`` with ``n = num_layers / pp`` (megatron-core's own offset rule,
``get_transformer_layer_offset``, without uneven first/last stages). The first stage also holds
the embedding, the last the final norm and the output layer.

With virtual stages (``vp`` model chunks per rank, megatron-core's interleaving) the layers form
``pp * vp`` blocks of ``n = num_layers / (pp * vp)``: chunk ``v`` of rank ``s`` holds block
``v * pp + s``, i.e. layers ``[(v * pp + s) * n, (v * pp + s + 1) * n)`` (megatron-core's
``get_transformer_layer_offset`` with ``vp_stage``). Activations go round the ring: rank ``pp - 1``
sends chunk ``v``'s output to chunk ``v + 1`` of rank 0 (``RingLink``).

Every rank of every stage reads the pack's THD batch from its own loader (the ranks of one DP
rank draw the same packs, as the TP and CP ranks of a stage already do), so each one builds its
own ``PackedSeqParams`` from the pack's ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen``:
no stage and no TP rank waits for another to broadcast the boundaries (the middle-stage traps of
Megatron-Bridge #2952 and Megatron-LM #4092 have nothing to forget). Tokens enter on the first
stage only, labels and the loss mask on the last.

``StageLink`` moves activations (forward) and their gradients (backward) between adjacent
stages over point-to-point sends of the pipeline group (gloo on CPU). Packs vary in length, so
a forward send is preceded by its shape (a 4-entry int64 header) unless the run has fixed
shapes (``data.pad_to_max_length`` with ``packing.pad_cu_seqlens``: every pack is
``packed_sequence_size`` tokens, CUDA graphs), where the receiver knows the shape beforehand and
the header is skipped. A gradient has the shape of the activation it belongs to, which the
receiving stage produced itself: it never needs a header.

Example (pp=2, the activation of a pack of T=24 tokens at CP=2, hidden 64)::

    link = StageLink(pp_group, dtype=torch.float32)           # variable shapes
    link.send_forward(hidden)          # stage 0: header [3, 12, 1, 64], then the [12, 1, 64] tensor
    hidden = link.recv_forward()       # stage 1: reads the header, then the tensor
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["RingLink", "StageLayout", "StageLink", "fixed_activation_shape", "stage_layout"]

_HEADER_LEN = 4
"""Shape header: [ndim, d0, d1, d2] (activations are [sequence, batch, hidden])."""
_TAG_SHAPE, _TAG_FORWARD, _TAG_BACKWARD = 1, 2, 3


@dataclass(frozen=True, slots=True)
class StageLayout:
    """The layers one pipeline stage holds.

    >>> s = stage_layout(num_layers=4, pp_size=2, pp_rank=1)
    >>> (s.layer_offset, s.num_local_layers, s.is_first, s.is_last)
    (2, 2, False, True)
    >>> s = stage_layout(num_layers=8, pp_size=2, pp_rank=1, vp_size=2, vp_stage=0)  # layers 2, 3 of 8
    >>> (s.layer_offset, s.num_local_layers, s.is_first, s.is_last)
    (2, 2, False, False)
    """

    num_layers: int
    """Transformer layers of the whole model."""
    pp_size: int
    """Pipeline stages."""
    pp_rank: int
    """This stage (0 = first)."""
    vp_size: int = 1
    """Model chunks per pipeline rank (virtual stages)."""
    vp_stage: int = 0
    """This chunk of the rank (0 = first)."""

    @property
    def num_local_layers(self) -> int:
        """Layers this chunk holds: num_layers / (pp_size * vp_size)."""
        return self.num_layers // (self.pp_size * self.vp_size)

    @property
    def layer_offset(self) -> int:
        """Global index of this chunk's first layer (block vp_stage * pp_size + pp_rank)."""
        return (self.vp_stage * self.pp_size + self.pp_rank) * self.num_local_layers

    @property
    def is_first(self) -> bool:
        """Holds the embedding (the tokens enter here)."""
        return self.pp_rank == 0 and self.vp_stage == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm and the output layer (the loss is computed here)."""
        return self.pp_rank == self.pp_size - 1 and self.vp_stage == self.vp_size - 1


def stage_layout(num_layers: int, pp_size: int, pp_rank: int, vp_size: int = 1, vp_stage: int = 0) -> StageLayout:
    """Chunk ``vp_stage`` of stage ``pp_rank``; ``num_layers`` must divide by ``pp_size * vp_size``
    (``validate()`` says so first)."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside a pipeline of {pp_size} stages.")
    if vp_size < 1 or not 0 <= vp_stage < vp_size:
        raise ValueError(f"virtual stage {vp_stage} is outside {vp_size} model chunks per pipeline rank.")
    if num_layers % (pp_size * vp_size):
        raise ValueError(f"model.num_layers ({num_layers}) must be a multiple of parallel.pipeline_model_parallel_size "
                         f"x parallel.virtual_pipeline_model_parallel_size ({pp_size} x {vp_size}); every model chunk "
                         "holds the same layers.")
    return StageLayout(num_layers=num_layers, pp_size=pp_size, pp_rank=pp_rank, vp_size=vp_size, vp_stage=vp_stage)


def fixed_activation_shape(pack_size: int, *, cp: int, tp: int, sequence_parallel: bool,
                           hidden_size: int) -> tuple[int, int, int]:
    """The [sequence, batch, hidden] activation between stages when every pack is ``pack_size`` tokens.

    Example: pack 64, CP=2, TP=2 with sequence parallelism, hidden 32 -> (16, 1, 32).
    """
    local = pack_size // cp
    if sequence_parallel:
        local //= tp
    return (local, 1, hidden_size)


class StageLink:
    """Point-to-point activations and gradients between this stage and its neighbours.

    ``fixed_shape`` (every pack the same length) skips the shape header of forward sends; the
    receiver then allocates that shape. Every call pairs with the matching call of the
    neighbour (``send_forward`` with its ``recv_forward``, ...); the combined calls post their
    send before their receive, so two neighbours calling them at once never wait on each other.
    """

    def __init__(self, pp_group: dist.ProcessGroup, *, dtype: torch.dtype = torch.float32,
                 fixed_shape: Optional[Sequence[int]] = None, device: torch.device | str = "cpu"):
        self.group = pp_group
        self.dtype, self.device = dtype, torch.device(device)
        self.fixed_shape = tuple(fixed_shape) if fixed_shape is not None else None
        ranks = dist.get_process_group_ranks(pp_group)
        self.pp_rank, self.pp_size = dist.get_rank(pp_group), len(ranks)
        self.prev_rank = ranks[self.pp_rank - 1] if self.pp_rank > 0 else None
        self.next_rank = ranks[self.pp_rank + 1] if self.pp_rank < self.pp_size - 1 else None
        self.num_shape_exchanges = 0
        """Shape headers this stage sent or received (0 with fixed shapes)."""
        self.seconds_waiting = 0.0
        """Time spent blocked in sends and receives (the pipeline bubble, plus the transfers)."""

    @property
    def is_first(self) -> bool:
        return self.prev_rank is None

    @property
    def is_last(self) -> bool:
        return self.next_rank is None

    # ----- forward ---------------------------------------------------------------------------

    def recv_forward(self) -> Optional[torch.Tensor]:
        """The previous stage's activation (a leaf that requires grad); None on the first stage."""
        if self.is_first:
            return None
        shape = self.fixed_shape or self._recv_shape()
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._timed(dist.recv, tensor, src=self.prev_rank, group=self.group, tag=_TAG_FORWARD)
        return tensor.requires_grad_(True)

    def send_forward(self, output: torch.Tensor) -> None:
        """This stage's activation to the next stage (nothing on the last stage)."""
        self._wait(self._isend_forward(output))

    def send_forward_recv_backward(self, output: torch.Tensor, grad_of: torch.Tensor) -> Optional[torch.Tensor]:
        """Send ``output`` forward and receive the gradient of ``grad_of`` (the oldest activation still
        waiting for its backward, in 1F1B not ``output`` itself) from the next stage (None on the last)."""
        if self.is_last:
            return None
        works = self._isend_forward(output)
        grad = torch.empty(grad_of.shape, dtype=self.dtype, device=self.device)
        works.append(dist.irecv(grad, src=self.next_rank, group=self.group, tag=_TAG_BACKWARD))
        self._wait(works)
        return grad

    # ----- backward --------------------------------------------------------------------------

    def recv_backward(self, output: torch.Tensor) -> Optional[torch.Tensor]:
        """The gradient of this stage's ``output`` from the next stage (None on the last stage)."""
        if self.is_last:
            return None
        grad = torch.empty(output.shape, dtype=self.dtype, device=self.device)
        self._timed(dist.recv, grad, src=self.next_rank, group=self.group, tag=_TAG_BACKWARD)
        return grad

    def send_backward(self, input_grad: Optional[torch.Tensor]) -> None:
        """The gradient of this stage's input to the previous stage (nothing on the first stage)."""
        if self.is_first:
            return
        self._wait([dist.isend(self._wire(input_grad), dst=self.prev_rank, group=self.group, tag=_TAG_BACKWARD)])

    def send_backward_recv_forward(self, input_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Send ``input_grad`` back and receive the next micro-batch's activation (None on the first stage)."""
        if self.is_first:
            return None
        work = dist.isend(self._wire(input_grad), dst=self.prev_rank, group=self.group, tag=_TAG_BACKWARD)
        tensor = self.recv_forward()
        self._wait([work])
        return tensor

    # ----- pieces ----------------------------------------------------------------------------

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds_waiting += time.perf_counter() - start

    def _wait(self, works: list) -> None:
        self._timed(lambda: [work.wait() for work in works])

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(self.dtype).contiguous()

    def _isend_forward(self, output: torch.Tensor) -> list:
        if self.is_last:
            return []
        wire = self._wire(output)
        works = []
        if self.fixed_shape is None:
            # on the link's device: NCCL sends device tensors only
            header = torch.tensor([wire.dim(), *wire.shape] + [0] * (_HEADER_LEN - 1 - wire.dim()),
                                  dtype=torch.int64, device=self.device)
            works.append(dist.isend(header, dst=self.next_rank, group=self.group, tag=_TAG_SHAPE))
            self.num_shape_exchanges += 1
        elif tuple(wire.shape) != self.fixed_shape:
            raise ValueError(f"pipeline stage {self.pp_rank} produced an activation of shape {list(wire.shape)}, but "
                             f"fixed shapes (data.pad_to_max_length with packing.pad_cu_seqlens) promise "
                             f"{list(self.fixed_shape)}.")
        works.append(dist.isend(wire, dst=self.next_rank, group=self.group, tag=_TAG_FORWARD))
        self._keep = (header, wire) if self.fixed_shape is None else (wire,)  # alive until the sends finish
        return works

    def _recv_shape(self) -> tuple[int, ...]:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        self._timed(dist.recv, header, src=self.prev_rank, group=self.group, tag=_TAG_SHAPE)
        self.num_shape_exchanges += 1
        ndim = int(header[0])
        return tuple(int(d) for d in header[1:1 + ndim])


class RingLink:
    """Point-to-point activations and gradients between the model chunks of an interleaved pipeline.

    The chunks form a ring: rank ``s`` passes chunk ``v``'s output to chunk ``v`` of rank ``s + 1``,
    and rank ``pp - 1`` to chunk ``v + 1`` of rank 0 (gradients the other way round). Sends are
    posted and not waited for (:meth:`finish` waits for them at the end of the schedule), receives
    block until their data is there: with megatron-core's interleaved order every receive's data
    is sent by a step its peer reaches without waiting on this rank, so the schedule cannot hang.
    Messages carry the receiving chunk in their tag, so a receive never takes another chunk's
    tensor (NCCL ignores tags: there each pair of ranks receives in the order it sends, which the
    schedule keeps). Variable pack shapes travel in a 4-entry header before each forward tensor, as in
    :class:`StageLink`; ``fixed_shape`` skips it.

    Example (pp=2, vp=2: rank 1's chunk 0 output goes to rank 0's chunk 1)::

        link = RingLink(pp_group, num_chunks=2)
        link.send_forward(hidden, chunk=0)        # rank 1
        hidden = link.recv_forward(chunk=1)       # rank 0
    """

    def __init__(self, pp_group: dist.ProcessGroup, *, num_chunks: int, dtype: torch.dtype = torch.float32,
                 fixed_shape: Optional[Sequence[int]] = None, device: torch.device | str = "cpu"):
        self.group, self.num_chunks = pp_group, num_chunks
        self.dtype, self.device = dtype, torch.device(device)
        self.fixed_shape = tuple(fixed_shape) if fixed_shape is not None else None
        ranks = dist.get_process_group_ranks(pp_group)
        self.pp_rank, self.pp_size = dist.get_rank(pp_group), len(ranks)
        self.next_rank = ranks[(self.pp_rank + 1) % self.pp_size]
        self.prev_rank = ranks[(self.pp_rank - 1) % self.pp_size]
        self.num_shape_exchanges = 0
        """Shape headers this rank sent or received (0 with fixed shapes)."""
        self.seconds_waiting = 0.0
        """Time spent blocked in receives and in waiting for sends (the bubble, plus the transfers)."""
        self._sends: list[tuple[Any, torch.Tensor]] = []

    def is_first(self, chunk: int) -> bool:
        """Chunk ``chunk`` of this rank holds the embedding (nothing to receive forward)."""
        return self.pp_rank == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        """Chunk ``chunk`` of this rank holds the loss (nothing to send forward)."""
        return self.pp_rank == self.pp_size - 1 and chunk == self.num_chunks - 1

    def _tag(self, kind: int, chunk: int) -> int:
        return _TAG_BACKWARD + 1 + 3 * chunk + kind

    def send_forward(self, output: torch.Tensor, chunk: int) -> None:
        """Chunk ``chunk``'s output to the chunk that runs next (nothing from the last chunk)."""
        if self.is_last(chunk):
            return
        to_chunk = chunk + 1 if self.pp_rank == self.pp_size - 1 else chunk
        wire = output.detach().to(self.dtype).contiguous()
        if self.fixed_shape is None:  # on the link's device: NCCL sends device tensors only
            header = torch.tensor([wire.dim(), *wire.shape] + [0] * (_HEADER_LEN - 1 - wire.dim()),
                                  dtype=torch.int64, device=self.device)
            self._post(header, self.next_rank, self._tag(0, to_chunk))
            self.num_shape_exchanges += 1
        elif tuple(wire.shape) != self.fixed_shape:
            raise ValueError(f"pipeline stage {self.pp_rank} produced an activation of shape {list(wire.shape)}, but "
                             f"fixed shapes (data.pad_to_max_length with packing.pad_cu_seqlens) promise "
                             f"{list(self.fixed_shape)}.")
        self._post(wire, self.next_rank, self._tag(1, to_chunk))

    def recv_forward(self, chunk: int) -> Optional[torch.Tensor]:
        """The activation chunk ``chunk`` starts from (a leaf that requires grad); None for the first chunk."""
        if self.is_first(chunk):
            return None
        shape = self.fixed_shape
        if shape is None:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            self._recv(header, self.prev_rank, self._tag(0, chunk))
            self.num_shape_exchanges += 1
            header = header.tolist()
            shape = tuple(header[1:1 + header[0]])
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._recv(tensor, self.prev_rank, self._tag(1, chunk))
        return tensor.requires_grad_(True)

    def send_backward(self, input_grad: torch.Tensor, chunk: int) -> None:
        """The gradient of chunk ``chunk``'s input to the chunk that produced it (nothing from the first chunk)."""
        if self.is_first(chunk):
            return
        to_chunk = chunk - 1 if self.pp_rank == 0 else chunk
        self._post(input_grad.detach().to(self.dtype).contiguous(), self.prev_rank, self._tag(2, to_chunk))

    def recv_backward(self, output: torch.Tensor, chunk: int) -> Optional[torch.Tensor]:
        """The gradient of chunk ``chunk``'s ``output`` (None for the last chunk: its output is the loss)."""
        if self.is_last(chunk):
            return None
        grad = torch.empty(output.shape, dtype=self.dtype, device=self.device)
        self._recv(grad, self.next_rank, self._tag(2, chunk))
        return grad

    def finish(self) -> None:
        """Wait for every send posted (the end of a schedule)."""
        start = time.perf_counter()
        for work, _ in self._sends:
            work.wait()
        self._sends = []
        self.seconds_waiting += time.perf_counter() - start

    def _post(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        # finished sends release their buffers; the rest stay alive until they complete
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        self._sends.append((dist.isend(tensor, dst=dst, group=self.group, tag=tag), tensor))

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        start = time.perf_counter()
        dist.recv(tensor, src=src, group=self.group, tag=tag)
        self.seconds_waiting += time.perf_counter() - start
