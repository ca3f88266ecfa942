"""Pure-PyTorch THD attention with context parallelism: the local-spec core attention.

megatron-core's own ``DotProductAttention`` refuses ``packed_seq_params`` and CP, so the local
(non Transformer Engine) layer spec uses ``ThdCoreAttention`` instead. It computes causal
attention *within* each sub-sequence of ``cu_seqlens_padded``, reading only the real (unpadded)
tokens given by ``cu_seqlens``; padded query rows come out as zeros, as with TE's THD kernels.

Work and memory grow with the sum of squared sub-sequence lengths: the pack is processed one
sub-sequence at a time and never as a [T, T] score matrix.

Context parallelism (CP > 1): each rank holds 2*CP zigzag chunks of every sub-sequence
(``megatron_pack.parallel.cp.thd_partition_indices``). K and V are all-gathered over the CP
group with an autograd-aware all-gather (its backward sums the K/V gradients of every rank and
hands each rank the rows it owns), put back at their global positions, and every local query
attends exactly to the keys at or before its global position in its own sub-sequence.

Worked example (one rank, CP=1): ``cu_seqlens=[0, 3, 5]``, ``cu_seqlens_padded=[0, 4, 8]``.
Rows 0-2 attend causally to rows 0-2; row 3 is padding (output 0); rows 4-5 attend causally to
rows 4-5; rows 6-7 are padding. With CP=2 the same pack is split into chunks of 1 token per
sub-sequence: rank 0 holds rows [0, 3, 4, 7], rank 1 holds rows [1, 2, 5, 6]. Rank 1's query
row 2 (global) attends to global keys 0-2, which it receives from the K/V all-gather.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron_pack.config.choices import ATTENTION_MODES  # re-exported: model.attention.ATTENTION_MODES
from megatron_pack.model.attention_reach import attend_with_sink, first_key, reach_mask, sink_logits, window_left
from megatron_pack.parallel.comm import all_gather_into_tensor, reduce_scatter_tensor


def _as_list(values) -> list[int]:
    return values.tolist() if isinstance(values, Tensor) else [int(v) for v in values]


def _check_thd_inputs(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: list[int],
                      cu_seqlens_padded: list[int], query_index: list[int]) -> None:
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"thd_attention expects query [Tq, heads, dim] and key/value [T, kv_heads, dim]; "
                         f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}.")
    if query.size(1) % key.size(1) != 0:
        raise ValueError(f"query heads ({query.size(1)}) must be a multiple of key/value heads ({key.size(1)}).")
    if len(cu_seqlens) != len(cu_seqlens_padded) or cu_seqlens_padded[-1] != key.size(0):
        raise ValueError(f"cu_seqlens ({len(cu_seqlens)} entries) and cu_seqlens_padded ({len(cu_seqlens_padded)} "
                         f"entries, last {cu_seqlens_padded[-1]}) must have the same length and the padded total "
                         f"must equal the number of key rows ({key.size(0)}).")
    for i in range(len(cu_seqlens) - 1):
        real, padded = cu_seqlens[i + 1] - cu_seqlens[i], cu_seqlens_padded[i + 1] - cu_seqlens_padded[i]
        if not 0 <= real <= padded:
            raise ValueError(f"sub-sequence {i}: real length {real} (from cu_seqlens) must be in "
                             f"[0, padded length {padded}] (from cu_seqlens_padded).")
    if len(query_index) != query.size(0):
        raise ValueError(f"query_index has {len(query_index)} entries for {query.size(0)} query rows.")
    if query_index and not 0 <= min(query_index) <= max(query_index) < cu_seqlens_padded[-1]:
        raise ValueError(f"query_index must lie in [0, {cu_seqlens_padded[-1]}) (rows of the pack).")


def _sequence_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: list[int], key_start: int, scale: float,
                        dropout_p: float, left: Optional[int] = None, sink: Optional[Tensor] = None) -> Tensor:
    """Causal attention of queries at in-sequence positions ``q_pos`` over the keys at positions ``key_start`` on.

    q [m, hq, d], k/v [n, hk, d] holding positions key_start .. max(q_pos); returns [m, hq, d]. ``left``: the
    window (``attention_reach``), ``sink`` [hq]: a sink logit per head. Queries at positions 0..n-1 in order
    without window or sink take SDPA's causal kernel; any other set (CP chunks, windows) an explicit [m, n] mask.
    """
    q_, k_, v_ = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if sink is None and left is None and key_start == 0 and q_pos == list(range(k.size(0))):
        kwargs = {"scale": scale, "enable_gqa": q_.size(0) != k_.size(0), "dropout_p": dropout_p}
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, **kwargs).transpose(0, 1)
    mask = reach_mask(torch.tensor(q_pos, device=q.device), key_start, k.size(0), left)
    if sink is not None:
        return attend_with_sink(q_, k_, v_, mask, scale, sink, dropout_p).transpose(0, 1)
    kwargs = {"scale": scale, "enable_gqa": q_.size(0) != k_.size(0), "dropout_p": dropout_p}
    return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, **kwargs).transpose(0, 1)


def _real_query_rows(query_index: list[int], cu: list[int], cu_pad: list[int]):
    """Per sub-sequence with real queries: (sequence, local rows, in-sequence positions); host-side ints.

    Local rows must be grouped by sub-sequence in pack order (true for CP zigzag slices).
    Example: query_index [0, 3, 4, 7], cu [0, 3, 5], cu_pad [0, 4, 8] -> (0, [0], [0]) and
    (1, [2], [0]): rows 1 and 3 are padding.
    """
    seq = 0
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for row, index in enumerate(query_index):
        while index >= cu_pad[seq + 1]:
            seq += 1
        position = index - cu_pad[seq]
        if position < cu[seq + 1] - cu[seq]:
            rows, positions = groups.setdefault(seq, ([], []))
            rows.append(row)
            positions.append(position)
    return [(s, rows, positions) for s, (rows, positions) in groups.items()]


def _window_blocks(groups, left: Optional[int], min_block: int = 128):
    """Split each sub-sequence's query rows into blocks of ``max(left + 1, min_block)`` under a window, so a block
    reads at most ``2 * block`` keys: work grows with length x window, not length squared. Unchanged without one.

    Example: left 1, min_block 2, rows [0..4] at positions [0..4] -> blocks [0, 1], [2, 3], [4].
    """
    for seq, rows, positions in groups:
        if left is None:
            yield seq, rows, positions
            continue
        block = max(left + 1, min_block)
        for i in range(0, len(rows), block):
            yield seq, rows[i:i + block], positions[i:i + block]


def thd_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens, cu_seqlens_padded, *,
                  softmax_scale: Optional[float] = None, query_index: Optional[Tensor] = None,
                  mode: str = "thd", dropout_p: float = 0.0, window_size=None, sink: Optional[Tensor] = None
                  ) -> Tensor:
    """Causal attention inside each sub-sequence of a THD pack; padded rows are ignored.

    query [Tq, hq, d]; key, value [T, hk, d] in global pack order (T = cu_seqlens_padded[-1]);
    hq a multiple of hk (GQA). ``query_index`` [Tq] gives each query row's global row in the
    pack (default ``arange(T)``; under CP the rank's zigzag rows, grouped by sub-sequence in
    order). Returns [Tq, hq, d]; rows that are padding come out as zeros. ``dropout_p`` drops
    attention probabilities (training only; 0 keeps runs deterministic). The bookkeeping runs on
    host-side ints, so a GPU call does not synchronise once per sub-sequence.

    ``mode='pack_causal'`` is the deliberately wrong attention used by ``verify.attention``:
    plain causal attention over the whole pack, as if it were one sequence.

    ``window_size`` (left, 0): the query at in-sequence position p reads positions max(0, p - left)..p of
    its own sub-sequence; ``sink`` [hq]: one extra softmax logit per query head (``model/attention_reach.py``).

    Example: cu_seqlens=[0, 3, 5], cu_seqlens_padded=[0, 4, 8]: rows 0-2 and 4-5 attend within
    their own sub-sequence; rows 3, 6, 7 are zeros. With window_size=(1, 0), row 2 reads rows 1-2 only.
    """
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode {mode!r} must be one of {list(ATTENTION_MODES)}.")
    total = key.size(0)
    cu, cu_pad = _as_list(cu_seqlens), _as_list(cu_seqlens_padded)
    if mode == "pack_causal":
        cu, cu_pad = [0, total], [0, total]
    rows_index = list(range(query.size(0))) if query_index is None else _as_list(query_index)
    _check_thd_inputs(query, key, value, cu, cu_pad, rows_index)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.size(-1))
    left = window_left(window_size)
    if sink is not None and sink.shape != (query.size(1),):
        raise ValueError(f"sink must hold one logit per query head ({query.size(1)}); got {tuple(sink.shape)}.")

    outputs, real_rows = [], []
    for seq, rows, positions in _window_blocks(_real_query_rows(rows_index, cu, cu_pad), left):
        first = first_key(positions, left)  # keys before the earliest window start are never read
        start, end = cu_pad[seq] + first, cu_pad[seq] + max(positions) + 1
        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        q = query[rows[0]:rows[-1] + 1] if contiguous else query.index_select(0, torch.tensor(rows, device=query.device))
        outputs.append(_sequence_attention(q, key[start:end], value[start:end], positions, first, scale, dropout_p,
                                           left, sink))
        real_rows += rows
    if outputs and real_rows == list(range(query.size(0))):
        return torch.cat(outputs)  # every row real and in order: nothing to scatter
    out = torch.zeros(query.shape[:2] + (value.size(-1),), dtype=query.dtype, device=query.device)
    if outputs:
        return out.index_copy(0, torch.tensor(real_rows, device=query.device), torch.cat(outputs))
    # No real query row (a CP slice of padding only): the zeros must still depend on query, key
    # and value, so this rank's backward reaches the K/V all-gather and enters its reduce-scatter,
    # which the other CP ranks wait in. Empty slices add exactly 0 (even where a value is inf/NaN).
    return out + (query[:0].sum() + key[:0].sum() + value[:0].sum()
                  + (sink[:0].sum() if sink is not None else 0)).to(out.dtype)


class _AllGatherRows(torch.autograd.Function):
    """All-gather along dim 0; backward sums every rank's gradient and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, local: Tensor, group) -> Tensor:
        ctx.group = group
        return all_gather_into_tensor(local, group=group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_tensor(grad, group=ctx.group), None


def gather_cp_rows(local: Tensor, cu_seqlens_padded, cp_group) -> Tensor:
    """All-gather this rank's zigzag rows over ``cp_group`` and return them in global pack order.

    local [T/CP, ...] -> [T, ...]; autograd-correct (each rank gets back the summed gradient of
    the rows it owns).
    """
    from megatron_pack.parallel.cp import thd_gather_order

    cp_size, gathered = dist.get_world_size(cp_group), _AllGatherRows.apply(local, cp_group)
    position_in_gathered = torch.argsort(thd_gather_order(torch.as_tensor(_as_list(cu_seqlens_padded)), cp_size))
    return gathered.index_select(0, position_in_gathered.to(local.device))


class _ThdCoreAttentionBody:
    """Core attention for megatron-core's local layer spec: THD packing, GQA and CP in pure torch.

    Drop-in for the ``core_attention`` submodule of ``SelfAttention``: it receives query
    [t, heads, dim] and key/value [t, kv_heads, dim] (THD, with ``packed_seq_params``) or
    [s, b, heads, dim] (SBHD, each row one causal sequence) and returns [t, heads*dim] /
    [s, b, heads*dim]. ``mode='pack_causal'`` is the broken setting used by ``verify``.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, mode: str = "thd"):
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"ThdCoreAttention computes causal attention only; got attn_mask_type={attn_mask_type}.")
        if mode not in ATTENTION_MODES:
            raise ValueError(f"verify.attention / attention mode {mode!r} must be one of {list(ATTENTION_MODES)}.")
        # apply_query_key_layer_scaling only trades a 1/layer factor between the scores and the
        # fp16 softmax in megatron's kernel; in exact arithmetic it is a no-op, so it is not applied.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.mode = mode
        self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") else None
        self.tp_group = pg_collection.tp if pg_collection is not None and hasattr(pg_collection, "tp") else None
        self.window_size = _layer_window_size(config, layer_number)
        self.softmax_type = config.softmax_type
        self._init_sink(config)

    def _init_sink(self, config) -> None:
        """``softmax_offset`` [heads of this TP rank] for softmax_type 'learnable' (megatron-core's name and split).

        Drawn whole with ``config.init_method`` and sliced by TP rank, so every TP size starts from the same
        sink logits (as the CPU initialisation of the linear weights)."""
        sink_from_type = config.softmax_type  # validated by sink_logits at the first forward
        if sink_from_type != "learnable":
            self.softmax_offset = None
            return
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
        heads = config.num_attention_heads // tp_size
        full = torch.zeros(config.num_attention_heads, dtype=config.params_dtype)
        if config.perform_initialization:
            config.init_method(full)
        self.softmax_offset = torch.nn.Parameter(full[tp_rank * heads:(tp_rank + 1) * heads].clone())
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The sink logits split over TP along the heads (as megatron-core's ``DotProductAttention``)."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True) if self.softmax_offset is not None else {}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    def _cp_size_rank(self, packed_seq_params) -> tuple[object, int, int]:
        group = getattr(packed_seq_params, "cp_group", None)
        group = group if group is not None else self.cp_group
        if group is None or not dist.is_initialized():
            return None, 1, 0
        return group, dist.get_world_size(group), dist.get_rank(group)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, cu, cu_pad, packed_seq_params) -> Tensor:
        group, cp_size, cp_rank = self._cp_size_rank(packed_seq_params)
        query_index = None
        if cp_size > 1:
            from megatron_pack.parallel.cp import thd_partition_indices

            kv = gather_cp_rows(torch.cat([key, value], dim=-1), cu_pad, group)
            key, value = kv.split([key.size(-1), value.size(-1)], dim=-1)
            query_index = thd_partition_indices(torch.as_tensor(_as_list(cu_pad)), cp_size, cp_rank).to(query.device)
        sink = sink_logits(self.softmax_type, self.softmax_offset, query.size(1), query)
        return thd_attention(query, key, value, cu, cu_pad, softmax_scale=self.softmax_scale,
                             query_index=query_index, mode=self.mode,
                             dropout_p=self.dropout_p if self.training else 0.0, window_size=self.window_size,
                             sink=sink)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None:
            raise ValueError("ThdCoreAttention does not support attention_bias.")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q
            cu_pad = packed_seq_params.cu_seqlens_q_padded if packed_seq_params.cu_seqlens_q_padded is not None else cu
            out = self._attend(query, key, value, cu, cu_pad, packed_seq_params)
            return out.reshape(out.size(0), -1)
        # SBHD: every batch row is one causal sequence of length s * CP (zigzag-split under CP).
        _, cp_size, _ = self._cp_size_rank(packed_seq_params)
        full = query.size(0) * cp_size
        rows = [self._attend(query[:, b], key[:, b], value[:, b], [0, full], [0, full], packed_seq_params)
                for b in range(query.size(1))]
        out = torch.stack(rows, dim=1)
        return out.reshape(out.size(0), out.size(1), -1)


def _layer_window_size(config, layer_number: int):
    """megatron-core's ``window_size`` where its rule (``is_layer_window_attention``) windows this layer, else None."""
    from megatron.core.transformer.utils import is_layer_window_attention

    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return tuple(config.window_size)
    return None


@functools.lru_cache(maxsize=None)
def _core_attention_class() -> type:
    from megatron.core.transformer.module import MegatronModule

    cls = type("ThdCoreAttention", (_ThdCoreAttentionBody, MegatronModule),
               {"__doc__": _ThdCoreAttentionBody.__doc__, "__module__": __name__})
    return cls


def __getattr__(name: str):
    # ThdCoreAttention subclasses megatron-core's MegatronModule; building it on first use keeps
    # ``thd_attention`` importable (and unit-testable) without importing megatron-core.
    if name == "ThdCoreAttention":
        return _core_attention_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
