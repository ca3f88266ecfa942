"""Pipeline stages: which layers a stage holds, and the shape of the activations between stages.

A pipeline of ``pp`` stages splits ``num_layers`` transformer layers evenly: stage ``s`` holds
layers ``[s * n, (s + 1) * n)`` with ``n = num_layers / pp`` (megatron-core's own offset rule,
``get_transformer_layer_offset``, without uneven first/last stages). The first stage also holds
the embedding, the last the final norm and the output layer.

With virtual stages (``vp`` model chunks per rank, megatron-core's interleaving) the layers form
``pp * vp`` blocks of ``n = num_layers / (pp * vp)``: chunk ``v`` of rank ``s`` holds block
``v * pp + s``, i.e. layers ``[(v * pp + s) * n, (v * pp + s + 1) * n)`` (megatron-core's
``get_transformer_layer_offset`` with ``vp_stage``). Activations go round the ring: rank ``pp - 1``
sends chunk ``v``'s output to chunk ``v + 1`` of rank 0 (megatron-core's interleaved schedule).

Every rank of every stage reads the pack's THD batch from its own loader (the ranks of one DP
rank draw the same packs, as the TP and CP ranks of a stage already do), so each one builds its
own ``PackedSeqParams`` from the pack's ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen``:
no stage and no TP rank waits for another to broadcast the boundaries (the middle-stage traps of
Megatron-Bridge #2952 and Megatron-LM #4092 have nothing to forget). Tokens enter on the first
stage only, labels and the loss mask on the last.

Activations (forward) and their gradients (backward) move between stages by megatron-core's
``P2PCommunicator`` inside its schedules (``training.schedule.forward_backward``), on every device.
Packs vary in length, so each forward send is preceded by its shape (``config.variable_seq_lengths``)
unless the run has fixed shapes (``data.pad_to_max_length`` with ``packing.pad_cu_seqlens``: every
pack is ``packed_sequence_size`` tokens, CUDA graphs), where every stage knows the activation's shape
beforehand (:func:`fixed_activation_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageLayout", "fixed_activation_shape", "stage_layout"]


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
