"""Hugging Face <-> megatron-core parameter names and layouts: one table per family, both directions.

A ``Rule`` names one megatron-core parameter, the Hugging Face tensor(s) it is made of, and the
transform between them. The same rule loads (HF tensors -> this TP rank's shard, reading only
the slices the shard needs) and exports (every TP rank's shard -> the HF tensors). Transforms,
with the shapes of a model of ``H=64`` hidden, ``nq=4`` query heads in ``ng=2`` groups of head
dim ``d=16``, ``F=96`` FFN, vocabulary ``V=301`` at TP=2:

``replicated``  norms: the same [H] tensor on every TP rank.
``row``         RowParallelLinear, split along dim 1: o_proj [64, 64] -> linear_proj [64, 32] per rank.
``vocab``       rows split after padding V to a multiple of TP: embed_tokens [301, 64] -> Vp=302,
                [151, 64] per rank; rank 1's last row is padding (zeros), dropped again on export.
``qkv``         q/k/v [64|32|32, 64] -> linear_qkv [(nq/ng + 2) * d * ng / TP, 64] = [64, 64] per rank,
                grouped per query group: rank 0 holds group 0 = [q heads 0, 1; k head 0; v head 0].
``gate_up``     gate/up [96, 64] -> linear_fc1 [2 * 96 / TP, 64] = [96, 64] per rank = [gate_r; up_r].

megatron-core's local layer spec and Transformer Engine's name the two pre-norms differently
(TE fuses them into the next linear); ``TE_ALIASES`` maps one to the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import Tensor

from megatron_pack.model.hf.rules import (FAMILY_RULES, IGNORED_HF, LLAMA, QK_NORM, QKV_BIAS, TE_ALIASES,  # noqa: F401
                                        Rule, rules_for)

class Reader(Protocol):
    """Reads Hugging Face tensors, or slices of them, from disk."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> Tensor: ...


@dataclass(frozen=True)
class Dims:
    """The sizes the transforms need, from our ``ModelConfig``."""

    num_heads: int
    num_groups: int
    head_dim: int
    ffn: int
    vocab: int
    tp: int

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // self.tp) * self.tp

    @classmethod
    def from_model_config(cls, model, tp: int) -> "Dims":
        heads = model.num_attention_heads
        return cls(num_heads=heads, num_groups=model.num_query_groups or heads,
                   head_dim=model.kv_channels or model.hidden_size // heads, ffn=model.ffn_hidden_size,
                   vocab=model.vocab_size, tp=tp)


def _rows(rank: int, per_rank: int) -> slice:
    return slice(rank * per_rank, (rank + 1) * per_rank)


def load_shard(rule: Rule, hf_names: tuple[str, ...], reader: Reader, dims: Dims, tp_rank: int) -> Tensor:
    """This TP rank's shard of ``rule``'s parameter, reading only the slices it needs."""
    tp = dims.tp
    if rule.kind == "replicated":
        return reader.read(hf_names[0])
    if rule.kind == "row":
        width = reader.shape(hf_names[0])[1]
        return reader.read(hf_names[0], None, _rows(tp_rank, width // tp))
    if rule.kind == "vocab":
        return _load_vocab(hf_names[0], reader, dims, tp_rank)
    if rule.kind == "qkv":
        return _load_qkv(hf_names, reader, dims, tp_rank)
    if rule.kind == "gate_up":
        per = dims.ffn // tp
        return torch.cat([reader.read(hf_names[0], _rows(tp_rank, per)), reader.read(hf_names[1], _rows(tp_rank, per))])
    raise ValueError(f"unknown transform {rule.kind!r}")


CHUNK_BYTES = 16 * 2**20
"""Largest single read when filling a parameter in place (``load_shard_into``)."""


def shard_shape(rule: Rule, hf_names: tuple[str, ...], reader: Reader, dims: Dims) -> tuple[int, ...]:
    """The shape of one TP rank's shard, from the HF tensors' shapes (nothing is read)."""
    shapes = [reader.shape(n) for n in hf_names]
    first, tp = shapes[0], dims.tp
    if rule.kind == "replicated":
        return first
    if rule.kind == "row":
        return (first[0], first[1] // tp)
    if rule.kind == "vocab":
        return (dims.padded_vocab // tp,) + first[1:]
    return (sum(s[0] for s in shapes) // tp,) + first[1:]  # qkv, gate_up


def load_shard_into(rule: Rule, hf_names: tuple[str, ...], reader: Reader, dims: Dims, tp_rank: int,
                    out: Tensor) -> None:
    """``out.copy_(load_shard(...))`` without the temporary: the two big single-tensor transforms
    (vocab rows, row-parallel columns) are read in row chunks of at most ``CHUNK_BYTES`` straight
    into ``out``, so loading a 1 GB embedding costs 16 MB of extra memory, not 1 GB."""
    if rule.kind not in ("vocab", "row"):
        out.copy_(load_shard(rule, hf_names, reader, dims, tp_rank))
        return
    name = hf_names[0]
    row_bytes = max(1, out[0].numel() * out.element_size())
    step = max(1, CHUNK_BYTES // row_bytes)
    if rule.kind == "row":
        cols = _rows(tp_rank, out.shape[1])
        for a in range(0, out.shape[0], step):
            out[a:a + step].copy_(reader.read(name, slice(a, min(a + step, out.shape[0])), cols))
        return
    per = out.shape[0]
    start, stop = tp_rank * per, min((tp_rank + 1) * per, dims.vocab)
    for a in range(start, stop, step):
        b = min(a + step, stop)
        out[a - start:b - start].copy_(reader.read(name, slice(a, b)))
    out[max(stop - start, 0):].zero_()  # vocabulary padding rows


def _load_vocab(name: str, reader: Reader, dims: Dims, tp_rank: int) -> Tensor:
    """Rows [r*Vp/TP, (r+1)*Vp/TP) of the vocabulary padded to Vp; pad rows are zeros."""
    per = dims.padded_vocab // dims.tp
    start, stop = tp_rank * per, min((tp_rank + 1) * per, dims.vocab)
    real = reader.read(name, slice(start, max(start, stop)))
    if real.shape[0] == per:
        return real
    return torch.cat([real, real.new_zeros((per - real.shape[0],) + tuple(real.shape[1:]))])


def _load_qkv(names: tuple[str, ...], reader: Reader, dims: Dims, tp_rank: int) -> Tensor:
    """[q heads of group g; k head g; v head g] for this rank's groups, g in order.

    Example nq=4, ng=2, d=16, TP=2, rank 1: q rows 32-63 (heads 2, 3), k rows 16-31, v rows 16-31
    -> [q2, q3, k1, v1] = [64, H].
    """
    groups = dims.num_groups // dims.tp
    per_group = dims.num_heads // dims.num_groups
    d = dims.head_dim
    q = reader.read(names[0], _rows(tp_rank, groups * per_group * d))
    k = reader.read(names[1], _rows(tp_rank, groups * d))
    v = reader.read(names[2], _rows(tp_rank, groups * d))
    tail = tuple(q.shape[1:])
    fused = torch.cat([q.reshape((groups, per_group * d) + tail), k.reshape((groups, d) + tail),
                       v.reshape((groups, d) + tail)], dim=1)
    return fused.reshape((groups * (per_group + 2) * d,) + tail)


def export_tensors(rule: Rule, shards: list[Tensor], dims: Dims) -> list[Tensor]:
    """The HF tensor(s) of ``rule`` from every TP rank's shard (rank order): the inverse of ``load_shard``."""
    if rule.kind == "replicated":
        return [shards[0]]
    if rule.kind == "row":
        return [torch.cat(shards, dim=1)]
    if rule.kind == "vocab":
        return [torch.cat(shards, dim=0)[:dims.vocab]]
    if rule.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if rule.kind == "qkv":
        return _export_qkv(shards, dims)
    raise ValueError(f"unknown transform {rule.kind!r}")


def _export_qkv(shards: list[Tensor], dims: Dims) -> list[Tensor]:
    per_group, d = dims.num_heads // dims.num_groups, dims.head_dim
    qs, ks, vs = [], [], []
    for shard in shards:
        tail = tuple(shard.shape[1:])
        grouped = shard.reshape((-1, (per_group + 2) * d) + tail)
        q, k, v = grouped.split([per_group * d, d, d], dim=1)
        qs.append(q.reshape((-1,) + tail))
        ks.append(k.reshape((-1,) + tail))
        vs.append(v.reshape((-1,) + tail))
    return [torch.cat(qs), torch.cat(ks), torch.cat(vs)]
