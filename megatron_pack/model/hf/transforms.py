"""The transforms between Hugging Face tensors and megatron-core shards: one class each, registered by name.

A family record's rule names its transform (``Rule(..., "qkv", ...)``, ``config/hf_config/families.py``);
``transform("qkv")`` is the object that knows, for that layout:

* ``hf_shapes``   the HF tensors' shapes that config.json implies (the folder check, torch-free);
* ``shard_shape`` one rank's shard, from the HF tensors' shapes (nothing is read);
* ``load``        HF tensors -> one rank's shard, reading only the slices that shard needs
                  (``load_into`` fills a parameter in place);
* ``export``      every rank's shard, in rank order -> the HF tensors: the inverse of ``load``.

Worked shapes for hidden ``H=64``, ``nq=4`` query heads in ``ng=2`` groups of head dim ``d=16``,
FFN ``F=96``, vocabulary ``V=301``, split over 2 ranks:

``replicated``  norms: the same [H] (or [d]) tensor on every rank.
``row``         RowParallelLinear, split along dim 1: o_proj [64, 64] -> linear_proj [64, 32] per rank.
``vocab``       rows split after padding V to a multiple of the ranks: embed_tokens [301, 64] -> Vp=302,
                [151, 64] per rank; rank 1's last row is padding (zeros), dropped again on export.
``qkv``         q/k/v [64|32|32, 64] -> linear_qkv [(nq/ng + 2) * d * ng / 2, 64] = [64, 64] per rank,
                grouped per query group: rank 0 holds group 0 = [q heads 0, 1; k head 0; v head 0].
``gate_up``     gate/up [96, 64] -> linear_fc1 [2 * 96 / 2, 64] = [96, 64] per rank = [gate_r; up_r].

A transform sees one split axis: ``dims.tp`` ranks and ``rank`` on it. Which axis that is (tensor
parallel, or expert tensor parallel for an expert's weight) is decided once, for every transform,
by the mapping base (``mapping.load_shard``). A new layout is one class here with
``@register_transform``. Importing this module does not import torch (the folder check uses it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Optional, Protocol

if TYPE_CHECKING:
    from torch import Tensor


class Reader(Protocol):
    """Reads Hugging Face tensors, or slices of them, from disk (or memory)."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> Tensor: ...


@dataclass(frozen=True)
class Dims:
    """The sizes the transforms need (from our ``ModelConfig``) and the degrees weights split over."""

    num_heads: int
    num_groups: int
    head_dim: int
    ffn: int
    vocab: int
    tp: int
    """Ranks a weight is split over (tensor parallel; ``for_experts`` makes it the expert TP)."""
    hidden: Optional[int] = None
    """Hidden size (for the HF shapes config.json implies; loading reads the shapes from the files)."""
    ep: int = 1
    """Expert-parallel ranks: each holds ``num_experts / ep`` experts of every MoE layer."""
    etp: Optional[int] = None
    """Expert tensor-parallel ranks an expert's weight is split over (None: ``tp``, megatron-core's default)."""
    num_experts: int = 0
    """Experts per MoE layer (0: a dense model)."""
    expert_ffn: Optional[int] = None
    """One expert's FFN size (``model.moe_ffn_hidden_size``)."""
    shared_ffn: Optional[int] = None
    """A shared expert's FFN size (``model.moe_shared_expert_ffn_hidden_size``)."""
    linear_qk: Optional[int] = None
    """A linear-attention layer's query (= key) width: key heads x key head dim (Qwen3.5's Gated DeltaNet)."""
    linear_v: Optional[int] = None
    """Its value width: value heads x value head dim."""
    linear_heads: Optional[int] = None
    """Its value heads."""
    linear_dv: Optional[int] = None
    """Its value head dim."""
    conv_width: Optional[int] = None
    """Its conv1d width."""

    def __post_init__(self):
        if self.num_experts % self.ep:
            raise ValueError(f"{self.num_experts} experts do not divide over {self.ep} expert-parallel ranks.")

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // self.tp) * self.tp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def num_local_experts(self) -> int:
        """Experts of one MoE layer on one expert-parallel rank."""
        return self.num_experts // self.ep

    def expert_offset(self, ep_rank: int) -> int:
        """Global index of expert-parallel rank ``ep_rank``'s first expert (its local expert 0)."""
        return ep_rank * self.num_local_experts

    def for_experts(self) -> "Dims":
        """These sizes with the split axis an expert's weight uses (expert tensor parallel)."""
        return replace(self, tp=self.expert_tp)

    def size(self, name: str) -> int:
        """A size a rule's ``shape`` names (``record.SHAPE_SIZES``)."""
        sizes = {"hidden": self.hidden, "ffn": self.ffn, "vocab": self.vocab, "head_dim": self.head_dim,
                 "q": self.num_heads * self.head_dim, "kv": self.num_groups * self.head_dim,
                 "experts": self.num_experts or None, "expert_ffn": self.expert_ffn, "shared_ffn": self.shared_ffn, "one": 1,
                 "heads": self.num_heads}
        if self.linear_qk is not None:
            sizes.update({"lin_conv": 2 * self.linear_qk + self.linear_v, "lin_v": self.linear_v,
                          "lin_heads": self.linear_heads, "lin_dv": self.linear_dv, "conv_width": self.conv_width})
        if sizes.get(name) is None:
            raise ValueError(f"Dims has no size {name!r} (set {name} for the shapes config.json implies).")
        return sizes[name]

    @classmethod
    def from_model_config(cls, model, tp: int, *, ep: int = 1, etp: Optional[int] = None) -> "Dims":
        """From ``model.*`` (our ``ModelConfig``, or anything with its attribute names; a MoE model's
        ``num_experts`` and ``moe_ffn_hidden_size`` give the expert sizes)."""
        heads = model.num_attention_heads
        return cls(num_heads=heads, num_groups=model.num_query_groups or heads,
                   head_dim=model.kv_channels or model.hidden_size // heads, ffn=model.ffn_hidden_size,
                   vocab=model.vocab_size, tp=tp, hidden=model.hidden_size, ep=ep, etp=etp,
                   num_experts=getattr(model, "num_experts", None) or 0,
                   expert_ffn=getattr(model, "moe_ffn_hidden_size", None),
                   shared_ffn=getattr(model, "moe_shared_expert_ffn_hidden_size", None), **_linear_dims(model))


def _linear_dims(model) -> dict:
    """The linear-attention sizes of a hybrid ``model.*`` (``model.full_attention_interval``); {} otherwise."""
    if getattr(model, "full_attention_interval", None) is None:
        return {}
    return {"linear_qk": model.linear_num_key_heads * model.linear_key_head_dim,
            "linear_v": model.linear_num_value_heads * model.linear_value_head_dim,
            "linear_heads": model.linear_num_value_heads, "linear_dv": model.linear_value_head_dim,
            "conv_width": model.linear_conv_kernel_dim}


def _part(rank: int, per_rank: int) -> slice:
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _rows_per_read(out: Tensor, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // max(1, out[0].numel() * out.element_size()))


def _cat(tensors: list[Tensor], dim: int = 0) -> Tensor:
    import torch

    return torch.cat(tensors, dim=dim)


class Transform(ABC):
    """One layout between Hugging Face tensors and a megatron-core parameter (see the module docstring)."""

    name: ClassVar[str]
    """The name rules use for it."""
    split_dim: ClassVar[Optional[int]] = None
    """The dimension of the megatron-core weight split over ranks: 0 (rows: column-parallel linears,
    the vocabulary), 1 (columns: row-parallel linears) or None (replicated). LoRA splits A or B alike."""

    def hf_shapes(self, shape: tuple[int, ...], num_parts: int, dims: Dims) -> list[tuple[int, ...]]:
        """The HF tensors' shapes, given the rule's ``shape`` (resolved): every part that shape by default."""
        return [tuple(shape)] * num_parts

    @abstractmethod
    def shard_shape(self, hf_shapes: list[tuple[int, ...]], dims: Dims) -> tuple[int, ...]:
        """One rank's shard, from the HF tensors' shapes."""

    @abstractmethod
    def load(self, names: tuple[str, ...], reader: Reader, dims: Dims, rank: int) -> Tensor:
        """Rank ``rank``'s shard, reading only the slices it needs."""

    def load_into(self, names: tuple[str, ...], reader: Reader, dims: Dims, rank: int, out: Tensor, *,
                  chunk_bytes: int) -> None:
        """``out.copy_(self.load(...))``; the big single-tensor layouts read in chunks straight into ``out``."""
        out.copy_(self.load(names, reader, dims, rank))

    @abstractmethod
    def export(self, shards: list[Tensor], dims: Dims) -> list[Tensor]:
        """The HF tensors from every rank's shard (rank order): the inverse of ``load``."""

    def lora_b_to_hf(self, b: Tensor) -> Tensor:
        """A whole expert's LoRA B [out, r] (rows as megatron-core's linear) in the HF tensor's output order (peft's
        target_parameters on the stacked tensor); rows are in the same order unless a layout interleaves them."""
        return b

    def lora_b_from_hf(self, b: Tensor) -> Tensor:
        """The inverse of ``lora_b_to_hf``."""
        return b


TRANSFORMS: dict[str, Transform] = {}
"""Registered name -> transform (one stateless object per class)."""


def register_transform(cls: type[Transform]) -> type[Transform]:
    """Class decorator: rules may name ``cls.name`` from now on."""
    if cls.name in TRANSFORMS:
        raise ValueError(f"transform {cls.name!r} is registered already ({type(TRANSFORMS[cls.name]).__name__}).")
    TRANSFORMS[cls.name] = cls()
    return cls


def transform(name: str) -> Transform:
    if name not in TRANSFORMS:
        raise ValueError(f"unknown transform {name!r}; registered: {sorted(TRANSFORMS)} (model/hf/transforms.py).")
    return TRANSFORMS[name]


@register_transform
class Replicated(Transform):
    """A copy on every rank: norms (input, pre-MLP, final; Qwen3's per-head q/k norms). [H] -> [H]."""

    name = "replicated"

    def shard_shape(self, hf_shapes, dims):
        return tuple(hf_shapes[0])

    def load(self, names, reader, dims, rank):
        return reader.read(names[0])

    def export(self, shards, dims):
        return [shards[0]]


@register_transform
class RowParallel(Transform):
    """RowParallelLinear: columns split. o_proj [64, 64] -> linear_proj [64, 32]; rank r holds columns
    [32r, 32r + 32)."""

    name, split_dim = "row", 1

    def shard_shape(self, hf_shapes, dims):
        rows, cols = hf_shapes[0]
        return (rows, cols // dims.tp)

    def load(self, names, reader, dims, rank):
        width = reader.shape(names[0])[1]
        return reader.read(names[0], None, _part(rank, width // dims.tp))

    def load_into(self, names, reader, dims, rank, out, *, chunk_bytes):
        cols, step, num_rows = _part(rank, out.shape[1]), _rows_per_read(out, chunk_bytes), out.shape[0]
        for a in range(0, num_rows, step):
            out[a:a + step].copy_(reader.read(names[0], slice(a, min(a + step, num_rows)), cols))

    def export(self, shards, dims):
        return [_cat(shards, dim=1)]


@register_transform
class Vocab(Transform):
    """Vocabulary rows split after padding to a multiple of the ranks; pad rows are zeros.

    V=5 over 2 ranks: Vp=6, rank 0 rows [0, 3), rank 1 rows [3, 5) + one zero row.
    """

    name, split_dim = "vocab", 0

    def shard_shape(self, hf_shapes, dims):
        return (dims.padded_vocab // dims.tp,) + tuple(hf_shapes[0][1:])

    def _rows(self, dims: Dims, rank: int) -> tuple[int, int, int]:
        per = dims.padded_vocab // dims.tp
        start = rank * per
        return per, start, max(start, min(start + per, dims.vocab))

    def load(self, names, reader, dims, rank):
        per, start, stop = self._rows(dims, rank)
        real = reader.read(names[0], slice(start, stop))
        if real.shape[0] == per:
            return real
        return _cat([real, real.new_zeros((per - real.shape[0],) + tuple(real.shape[1:]))])

    def load_into(self, names, reader, dims, rank, out, *, chunk_bytes):
        per, start, stop = self._rows(dims, rank)
        step = _rows_per_read(out, chunk_bytes)
        for a in range(start, stop, step):
            b = min(a + step, stop)
            out[a - start:b - start].copy_(reader.read(names[0], slice(a, b)))
        out[stop - start:].zero_()  # vocabulary padding rows

    def export(self, shards, dims):
        whole = _cat(shards)
        if whole.shape[0] > dims.vocab and whole[dims.vocab:].any():  # TP pad rows stay zero; these are tokens
            raise ValueError(f"the checkpoint's vocabulary has {whole.shape[0]} rows holding values beyond the "
                             f"{dims.vocab} of the export source's config.json vocab_size (it was trained with "
                             "model.resize_vocab); export with its own hf_source (drop model.pretrained) so nothing "
                             "is cut.")
        return [whole[:dims.vocab]]


@register_transform
class FusedQKV(Transform):
    """q, k, v -> one linear_qkv, grouped per query group: [q heads of group g; k head g; v head g].

    Its rule's shape is one head's ((head_dim, hidden) for the weight, (head_dim,) for the bias).
    Example nq=4, ng=2, d=16 over 2 ranks, rank 1: q rows 32-63 (heads 2, 3), k rows 16-31,
    v rows 16-31 -> [q2, q3, k1, v1] = [64, H].
    """

    name, split_dim = "qkv", 0

    def hf_shapes(self, shape, num_parts, dims):
        head, tail = shape[0], tuple(shape[1:])
        return [(dims.num_heads * head,) + tail, (dims.num_groups * head,) + tail, (dims.num_groups * head,) + tail]

    def shard_shape(self, hf_shapes, dims):
        return (sum(s[0] for s in hf_shapes) // dims.tp,) + tuple(hf_shapes[0][1:])

    def load(self, names, reader, dims, rank):
        groups, per_group, d = dims.num_groups // dims.tp, dims.num_heads // dims.num_groups, dims.head_dim
        q = reader.read(names[0], _part(rank, groups * per_group * d))
        k = reader.read(names[1], _part(rank, groups * d))
        v = reader.read(names[2], _part(rank, groups * d))
        tail = tuple(q.shape[1:])
        fused = _cat([q.reshape((groups, per_group * d) + tail), k.reshape((groups, d) + tail),
                      v.reshape((groups, d) + tail)], dim=1)
        return fused.reshape((groups * (per_group + 2) * d,) + tail)

    def export(self, shards, dims):
        per_group, d = dims.num_heads // dims.num_groups, dims.head_dim
        qs, ks, vs = [], [], []
        for shard in shards:
            tail = tuple(shard.shape[1:])
            q, k, v = shard.reshape((-1, (per_group + 2) * d) + tail).split([per_group * d, d, d], dim=1)
            qs.append(q.reshape((-1,) + tail))
            ks.append(k.reshape((-1,) + tail))
            vs.append(v.reshape((-1,) + tail))
        return [_cat(qs), _cat(ks), _cat(vs)]


@register_transform
class GatedMLP(Transform):
    """gate, up -> linear_fc1 = [gate_r; up_r] on each rank r (the rows of both, split alike).

    gate/up [96, 64] over 2 ranks: rank 1 holds [gate rows 48-95; up rows 48-95] = [96, 64]. The
    rows per rank come from the tensors' own shape, so an expert's FFN size works the same.
    """

    name, split_dim = "gate_up", 0

    def shard_shape(self, hf_shapes, dims):
        return (sum(s[0] for s in hf_shapes) // dims.tp,) + tuple(hf_shapes[0][1:])

    def load(self, names, reader, dims, rank):
        rows = _part(rank, reader.shape(names[0])[0] // dims.tp)
        return _cat([reader.read(names[0], rows), reader.read(names[1], rows)])

    def export(self, shards, dims):
        halves = [s.chunk(2, dim=0) for s in shards]
        return [_cat([h[0] for h in halves]), _cat([h[1] for h in halves])]


@register_transform
class GatedQKV(Transform):
    """q (with its output gate), k, v -> linear_qkv with megatron-core's ``attention_output_gate`` layout, per query
    group g: [q heads of g; their gates; k head g; v head g]. HF's q_proj holds each head's query then its gate
    (Qwen3.5: [h0 query; h0 gate; h1 query; ...]).

    nq=4, ng=2, d=16 over 2 ranks, rank 1: q_proj rows 64-127 (heads 2, 3 with their gates), k rows 16-31, v rows
    16-31 -> [q2, q3, gate2, gate3, k1, v1] = [96, H].
    """

    name, split_dim = "qkv_gated", 0

    def hf_shapes(self, shape, num_parts, dims):
        head, tail = shape[0], tuple(shape[1:])
        return [(2 * dims.num_heads * head,) + tail, (dims.num_groups * head,) + tail, (dims.num_groups * head,) + tail]

    def shard_shape(self, hf_shapes, dims):
        return (sum(s[0] for s in hf_shapes) // dims.tp,) + tuple(hf_shapes[0][1:])

    def load(self, names, reader, dims, rank):
        groups, per_group, d = dims.num_groups // dims.tp, dims.num_heads // dims.num_groups, dims.head_dim
        q_gate = reader.read(names[0], _part(rank, groups * per_group * 2 * d))
        tail = tuple(q_gate.shape[1:])
        q, gate = q_gate.reshape((groups, per_group, 2, d) + tail).unbind(2)
        k = reader.read(names[1], _part(rank, groups * d)).reshape((groups, d) + tail)
        v = reader.read(names[2], _part(rank, groups * d)).reshape((groups, d) + tail)
        fused = _cat([q.reshape((groups, per_group * d) + tail), gate.reshape((groups, per_group * d) + tail), k, v],
                     dim=1)
        return fused.reshape((groups * (2 * per_group + 2) * d,) + tail)

    def export(self, shards, dims):
        import torch

        per_group, d = dims.num_heads // dims.num_groups, dims.head_dim
        qs, ks, vs = [], [], []
        for shard in shards:
            tail = tuple(shard.shape[1:])
            q, gate, k, v = shard.reshape((-1, (2 * per_group + 2) * d) + tail).split(
                [per_group * d, per_group * d, d, d], dim=1)
            pairs = torch.stack([q.reshape((-1, per_group, d) + tail), gate.reshape((-1, per_group, d) + tail)], 2)
            qs.append(pairs.reshape((-1,) + tail))
            ks.append(k.reshape((-1,) + tail))
            vs.append(v.reshape((-1,) + tail))
        return [_cat(qs), _cat(ks), _cat(vs)]


@register_transform
class LinearAttentionColumns(Transform):
    """A Gated DeltaNet's per-head tensors, split by heads over ranks as ``PackedGatedDeltaNet`` holds them: each
    HF tensor's rows split over the ranks, the [q; k; v] one (rows 2 * qk + v: ``in_proj_qkv``, ``conv1d``) section
    by section; rank r's shard is its parts in order.

    Qwen3.5, qk=16 (2 key heads of 8), v=32 (4 value heads of 8), hidden 32, over 2 ranks: in_proj_qkv [64, 32],
    in_proj_z [32, 32], in_proj_b, in_proj_a [4, 32] -> rank 1's in_proj = [q 8-15; k 8-15; v 16-31; z 16-31;
    b 2-3; a 2-3] = [44, 32]; conv1d [64, 1, 4] -> [q 8-15; k 8-15; v 16-31] = [32, 1, 4]; dt_bias [4] -> [2, 3].
    """

    name, split_dim = "gdn_columns", 0

    def hf_shapes(self, shape, num_parts, dims):
        if num_parts == 1:
            return [tuple(shape)]
        rows = [dims.size("lin_conv"), dims.linear_v, dims.linear_heads, dims.linear_heads][:num_parts]
        return [(r,) + tuple(shape[1:]) for r in rows]

    def shard_shape(self, hf_shapes, dims):
        return (sum(s[0] for s in hf_shapes) // dims.tp,) + tuple(hf_shapes[0][1:])

    @staticmethod
    def _sections(rows: int, dims: Dims) -> list[int]:
        """The sections of an HF tensor of ``rows`` rows that split over ranks separately."""
        if dims.linear_qk is not None and rows == 2 * dims.linear_qk + dims.linear_v:
            return [dims.linear_qk, dims.linear_qk, dims.linear_v]
        return [rows]

    def load(self, names, reader, dims, rank):
        parts = []
        for name in names:
            start = 0
            for size in self._sections(reader.shape(name)[0], dims):
                per_rank = size // dims.tp
                parts.append(reader.read(name, slice(start + rank * per_rank, start + (rank + 1) * per_rank)))
                start += size
        return _cat(parts)

    def export(self, shards, dims):
        if dims.linear_qk is None:
            raise ValueError("gdn_columns needs the linear-attention sizes (Dims.from_model_config of a hybrid model).")
        rows = shards[0].shape[0] * dims.tp
        full = 2 * dims.linear_qk + dims.linear_v
        sizes = ([full, dims.linear_v, dims.linear_heads, dims.linear_heads] if rows > full else [rows])
        sections = [s for size in sizes for s in self._sections(size, dims)]
        per_rank = [s.split([size // dims.tp for size in sections]) for s in shards]
        joined = [_cat([pieces[j] for pieces in per_rank]) for j in range(len(sections))]
        out, j = [], 0
        for size in sizes:
            count = len(self._sections(size, dims))
            out.append(_cat(joined[j:j + count]))
            j += count
        return out


@register_transform
class Heads(Transform):
    """One value per query head, the heads split over ranks as attention splits them (gpt-oss's sinks ->
    ``core_attention.softmax_offset``): [4] over 2 ranks, rank 1 holds heads 2, 3."""

    name, split_dim = "heads", 0

    def shard_shape(self, hf_shapes, dims):
        return (hf_shapes[0][0] // dims.tp,)

    def load(self, names, reader, dims, rank):
        return reader.read(names[0], _part(rank, reader.shape(names[0])[0] // dims.tp))

    def export(self, shards, dims):
        return [_cat(shards)]


def _rows_first(t: Tensor) -> Tensor:
    """A matrix transposed (x @ W's layout <-> a linear's weight); a bias vector as it is."""
    return t.T if t.dim() == 2 else t


@register_transform
class InterleavedGateUp(Transform):
    """One expert's [hidden, 2F] tensor whose columns interleave gate and up (gpt-oss's ``gate_up_proj[e]``:
    gate = [:, 0::2], up = [:, 1::2], applied as x @ W) -> ``linear_fc1`` [gate_r; up_r] on rank r, as
    ``gate_up``. Its bias [2F] interleaves alike -> [gate bias_r; up bias_r].

    H=64, F=48 over 2 ranks: gate_up_proj[e] [64, 96] -> rank 1 holds [gate cols 24-47; up cols 24-47].T = [48, 64].
    """

    name, split_dim = "interleaved_gate_up", 0

    def hf_shapes(self, shape, num_parts, dims):
        return [tuple(shape[:-1]) + (2 * shape[-1],)]

    def shard_shape(self, hf_shapes, dims):
        shape = hf_shapes[0]
        return (shape[-1] // dims.tp,) + tuple(shape[:-1])

    def load(self, names, reader, dims, rank):
        whole = reader.read(names[0])
        gate, up = whole[..., 0::2], whole[..., 1::2]
        cols = _part(rank, gate.shape[-1] // dims.tp)
        return _cat([_rows_first(gate[..., cols]), _rows_first(up[..., cols])]).contiguous()

    def export(self, shards, dims):
        halves = [s.chunk(2, dim=0) for s in shards]
        gate, up = _rows_first(_cat([h[0] for h in halves])), _rows_first(_cat([h[1] for h in halves]))  # [..., F]
        import torch

        return [torch.stack([gate, up], dim=-1).reshape(tuple(gate.shape[:-1]) + (2 * gate.shape[-1],)).contiguous()]

    def lora_b_to_hf(self, b):
        """B [2F, r] = [gate; up] rows -> HF's output order, gate and up interleaved: rows g0, u0, g1, u1, ..."""
        gate, up = b.chunk(2, dim=0)
        return _cat([gate, up], dim=1).reshape(b.shape).contiguous()

    def lora_b_from_hf(self, b):
        return _cat([b[0::2], b[1::2]]).contiguous()


@register_transform
class RowTransposed(Transform):
    """One expert's [F, hidden] tensor applied as x @ W (gpt-oss's ``down_proj[e]``) -> RowParallelLinear
    ``linear_fc2`` [hidden, F / tp]: its transpose, columns split. [48, 64] over 2 ranks: rank 1 holds rows
    24-47, transposed: [64, 24]."""

    name, split_dim = "row_transposed", 1

    def shard_shape(self, hf_shapes, dims):
        rows, cols = hf_shapes[0]
        return (cols, rows // dims.tp)

    def load(self, names, reader, dims, rank):
        rows = reader.shape(names[0])[0]
        return reader.read(names[0], _part(rank, rows // dims.tp)).T.contiguous()

    def export(self, shards, dims):
        return [_cat(shards, dim=1).T.contiguous()]


def _linear_oriented(whole: Tensor, out_rows: int) -> Tensor:
    """An expert's matrix as a linear's weight [out, in]: a Hub slice is [in, out] (applied as x @ W), transformers 5's
    ``save_pretrained`` keeps its module's [out, in]; told apart by which dim has the ``out_rows`` rows (a square
    matrix is read as the Hub's)."""
    return whole.T if whole.shape[-1] == out_rows else whole


@register_transform
class StackedGateUp(Transform):
    """One expert's slice of a stacked [experts, H, 2F] ``gate_up_proj`` (Qwen3-VL-MoE on the Hub: x @ W, gate
    columns then up columns; transformers' own [experts, 2F, H] reads too) -> ``linear_fc1`` [gate_r; up_r] on
    rank r, as ``gate_up``; written back in the Hub's [H, 2F].

    H=64, F=16 over 2 ranks: gate_up_proj[e] [64, 32] -> rank 1 holds [gate cols 8-15; up cols 8-15].T = [16, 64].
    """

    name, split_dim = "stacked_gate_up", 0

    def hf_shapes(self, shape, num_parts, dims):
        return [(shape[0], 2 * shape[1])]

    def shard_shape(self, hf_shapes, dims):
        rows, cols = hf_shapes[0]
        width = cols if cols == 2 * dims.expert_ffn else rows  # the 2F side, in either orientation
        return (width // dims.tp, rows + cols - width)

    def load(self, names, reader, dims, rank):
        weight = _linear_oriented(reader.read(names[0]), 2 * dims.expert_ffn)  # [2F, H]
        gate, up = weight.chunk(2, dim=0)
        rows = _part(rank, gate.shape[0] // dims.tp)
        return _cat([gate[rows], up[rows]]).contiguous()

    def export(self, shards, dims):
        halves = [s.chunk(2, dim=0) for s in shards]
        return [_cat([_cat([h[0] for h in halves]), _cat([h[1] for h in halves])]).T.contiguous()]


@register_transform
class StackedDown(Transform):
    """One expert's slice of a stacked [experts, F, H] ``down_proj`` (Qwen3-VL-MoE on the Hub: x @ W; transformers'
    own [experts, H, F] reads too) -> RowParallelLinear ``linear_fc2`` [H, F / tp]; written back in the Hub's
    [F, H]. [16, 64] over 2 ranks: rank 1 holds rows 8-15, transposed: [64, 8]."""

    name, split_dim = "stacked_down", 1

    def shard_shape(self, hf_shapes, dims):
        rows, cols = hf_shapes[0]
        ffn = rows if rows == dims.expert_ffn else cols
        return (rows + cols - ffn, ffn // dims.tp)

    def load(self, names, reader, dims, rank):
        whole = reader.read(names[0])
        weight = whole if whole.shape[-1] == dims.expert_ffn and whole.shape[0] != dims.expert_ffn else whole.T
        return weight[:, _part(rank, weight.shape[1] // dims.tp)].contiguous()  # [H, F / tp]

    def export(self, shards, dims):
        return [_cat(shards, dim=1).T.contiguous()]
