"""Hugging Face <-> megatron-core, both directions: a rule's transform applied on its split axis.

A family record's ``Rule`` names one megatron-core parameter, the Hugging Face tensor(s) it is
made of and the registered transform between them (``transforms.py``: each layout with worked
shapes). The same rule loads (HF tensors -> this rank's shard, reading only the slices the shard
needs) and exports (every rank's shard -> the HF tensors). What the transforms share is here,
once: the split axis of a rule's weight is tensor parallel (``dims.tp``, the TP rank), or expert
tensor parallel (``dims.expert_tp``, the expert-TP rank) for an expert's weight (a rule with
``{e}``), so no transform knows about experts.

megatron-core's local layer spec and Transformer Engine's name the two pre-norms differently
(TE fuses them into the next linear); ``TE_ALIASES`` maps one to the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_pack.config.hf_config.record import Rule
from megatron_pack.model.hf.transforms import Dims, Reader, transform

if TYPE_CHECKING:
    from torch import Tensor

CHUNK_BYTES = 16 * 2**20
"""Largest single read when filling a parameter in place (``load_shard_into``)."""


def split_axis(rule: Rule, dims: Dims, tp_rank: int, etp_rank: int = 0) -> tuple[Dims, int]:
    """(sizes with ``tp`` = the ranks ``rule``'s weight splits over, this rank on that axis)."""
    return (dims.for_experts(), etp_rank) if rule.per_expert else (dims, tp_rank)


def load_shard(rule: Rule, hf_names: tuple[str, ...], reader: Reader, dims: Dims, tp_rank: int, *,
               etp_rank: int = 0) -> Tensor:
    """This rank's shard of ``rule``'s parameter, reading only the slices it needs."""
    axis_dims, rank = split_axis(rule, dims, tp_rank, etp_rank)
    return transform(rule.kind).load(hf_names, reader, axis_dims, rank)


def shard_shape(rule: Rule, hf_names: tuple[str, ...], reader: Reader, dims: Dims) -> tuple[int, ...]:
    """The shape of one rank's shard, from the HF tensors' shapes (nothing is read)."""
    axis_dims, _ = split_axis(rule, dims, 0)
    return tuple(transform(rule.kind).shard_shape([tuple(reader.shape(n)) for n in hf_names], axis_dims))


def load_shard_into(rule: Rule, hf_names: tuple[str, ...], reader: Reader, dims: Dims, tp_rank: int, out: Tensor, *,
                    etp_rank: int = 0) -> None:
    """``out.copy_(load_shard(...))`` without the temporary where the layout allows: the two big
    single-tensor transforms (vocab rows, row-parallel columns) are read in row chunks of at most
    ``CHUNK_BYTES`` straight into ``out``, so loading a 1 GB embedding costs 16 MB of extra memory."""
    axis_dims, rank = split_axis(rule, dims, tp_rank, etp_rank)
    transform(rule.kind).load_into(hf_names, reader, axis_dims, rank, out, chunk_bytes=CHUNK_BYTES)


def export_tensors(rule: Rule, shards: list[Tensor], dims: Dims) -> list[Tensor]:
    """The HF tensor(s) of ``rule`` from every shard on its split axis (rank order): the inverse of
    ``load_shard``. For an expert's weight, ``shards`` are the expert-TP ranks' (given every TP rank's,
    with expert TP 1 they are replicas: the first is read)."""
    axis_dims, _ = split_axis(rule, dims, 0)
    return transform(rule.kind).export(shards[:axis_dims.tp], axis_dims)
