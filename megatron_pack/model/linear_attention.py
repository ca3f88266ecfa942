"""Packed Gated DeltaNet: a linear-attention layer of megatron-core's layer spec that takes THD packs.

megatron-core 0.16.1's ``GatedDeltaNet`` (``megatron/core/ssm/gated_delta_net.py``) raises
``NotImplementedError`` on ``packed_seq_params``, needs fla to be built and has no CP.
``PackedGatedDeltaNet`` keeps its parameters, names and checkpoint layout (``in_proj`` = [q, k, v, z,
beta, alpha] per TP rank, ``conv1d``, ``dt_bias``, ``A_log``, ``out_norm``, ``out_proj``; its
``sharded_state_dict`` is megatron-core's) and replaces the forward: the conv1d window and the
recurrent state restart at every ``cu_seqlens`` start and padding neither feeds nor receives state
(``model/delta_rule.py``, torch or fla kernel behind one contract).

Tensor parallelism splits the heads (megatron-core's layout: each TP rank's rows of ``in_proj`` are
[q, k, v, z, beta, alpha] of its heads); the ``out_norm`` weight, shared by every head, gets a partial
gradient per TP rank, summed over TP in backward (``_SumGradOverTP``), with or without sequence parallelism.

Context parallelism (CP > 1). Full-attention layers keep the zigzag THD slices (rank r holds chunks r
and 2CP-1-r of every sub-sequence). A recurrence needs each sub-sequence whole and in order, so this
layer trades the sequence split for a head split around the conv1d and the recurrence (DeepSpeed-Ulysses'
scheme; megatron-core 0.16.1 has no GDN CP)::

    local rows [T/CP] x all heads  --all-to-all-->  all T rows (global order) x heads/CP
    conv1d + delta rule on whole sub-sequences, this rank's heads
    all T rows x heads/CP          --all-to-all-->  local rows [T/CP] x all heads  -> gated norm, out_proj

The projections, the gate ``z`` and the output norm stay on the local rows. Per layer and direction,
each rank sends ``(CP-1)/CP`` of its local (q, k, v, beta, alpha) before and of its output after;
backward sends the same again (the all-to-all is its own adjoint). Each rank updates the conv1d
channels, ``dt_bias`` and ``A_log`` of its own heads; the DP x CP gradient all-reduce sums them.
Needs the key heads (per TP rank) divisible by CP.

Example: CP=2, ``cu_seqlens_padded=[0, 8]``, 4 value heads: rank 0 holds rows [0, 1, 6, 7] of heads
0-3; after the first all-to-all it holds rows 0-7 of heads 0-1, rank 1 rows 0-7 of heads 2-3.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron_pack.model.delta_rule import packed_causal_conv1d, packed_gated_delta_rule
from megatron_pack.parallel.comm import all_reduce, all_to_all_single


class _AllToAll(torch.autograd.Function):
    """[size, ...] chunks to their ranks over ``group``; backward is the same exchange."""

    @staticmethod
    def forward(ctx, chunks: Tensor, group) -> Tensor:
        ctx.group = group
        return all_to_all_single(chunks, group=group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_to_all_single(grad.contiguous(), group=ctx.group), None


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (a weight every TP rank uses on its own heads)."""

    @staticmethod
    def forward(ctx, weight: Tensor, group) -> Tensor:
        ctx.group = group
        return weight.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce(grad.contiguous().clone(), group=ctx.group), None


def sequence_to_heads(local: Tensor, cu_seqlens_padded, group) -> Tensor:
    """This rank's zigzag rows of every head group -> every row of this rank's head group, global order.

    local [T/CP, CP, w] (dim 1: the head group each CP rank will own) -> [T, w].
    """
    from megatron_pack.parallel.cp import thd_gather_order

    cp = local.size(1)
    received = _AllToAll.apply(local.transpose(0, 1).contiguous(), group)  # [CP (source rank), T/CP, w]
    order = torch.argsort(thd_gather_order(torch.as_tensor(cu_seqlens_padded).cpu(), cp)).to(local.device)
    return received.reshape(-1, received.size(-1)).index_select(0, order)


def heads_to_sequence(full: Tensor, cu_seqlens_padded, group, cp: int) -> Tensor:
    """The inverse of ``sequence_to_heads``: [T, w] (global order, this rank's heads) -> [T/CP, CP, w]."""
    from megatron_pack.parallel.cp import thd_gather_order

    order = thd_gather_order(torch.as_tensor(cu_seqlens_padded).cpu(), cp).to(full.device)
    chunks = full.index_select(0, order).reshape(cp, -1, full.size(-1))  # [CP (destination rank), T/CP, w]
    return _AllToAll.apply(chunks, group).transpose(0, 1)  # [T/CP, CP (head group), w]


def _gdn_class() -> type:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import build_module

    class PackedGatedDeltaNet(MegatronModule):
        """Gated DeltaNet over THD packs (module docstring); hidden [T_local, 1, h] -> ([T_local, 1, h], bias).

        Without ``packed_seq_params`` each batch column [s, b, h] is one whole sequence (zigzag-split under
        CP, as megatron-core slices SBHD batches). ``kernel``: 'auto' | 'torch' | 'fla' (``delta_rule.KERNELS``).
        """

        sharded_state_dict = GatedDeltaNet.sharded_state_dict  # the same parameters and checkpoint layout

        def __init__(self, config, submodules, layer_number: Optional[int] = None, bias: bool = False,
                     conv_bias: bool = False, use_qk_l2norm: bool = True, A_init_range=(1, 16),
                     pg_collection=None, kernel: str = "auto", **unused):
            super().__init__(config)
            self.layer_number, self.bias, self.conv_bias, self.kernel = layer_number, bias, conv_bias, kernel
            self.use_qk_l2norm, self.pg_collection = use_qk_l2norm, pg_collection
            tp_group = pg_collection.tp if pg_collection is not None else None
            self.tp_group, self.tp_size = tp_group, tp_group.size() if tp_group is not None else 1
            self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
            self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
            if self.num_value_heads % self.num_key_heads or self.num_key_heads % self.tp_size:
                raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                                 f"linear_num_key_heads ({self.num_key_heads}), itself a multiple of "
                                 f"tensor_model_parallel_size ({self.tp_size}).")
            self.qk_dim, self.v_dim = self.dk * self.num_key_heads, self.dv * self.num_value_heads
            self.in_proj_dim = 2 * self.qk_dim + 2 * self.v_dim + 2 * self.num_value_heads
            self.conv_dim = 2 * self.qk_dim + self.v_dim
            self.conv_dim_local_tp = self.conv_dim // self.tp_size
            # this TP rank's heads; in_proj's rows per rank are [q, k, v, z, beta, alpha] of them (megatron-core's)
            self.hk_tp, self.hv_tp = self.num_key_heads // self.tp_size, self.num_value_heads // self.tp_size
            self.in_proj = build_module(submodules.in_proj, config.hidden_size, self.in_proj_dim, config=config,
                                        init_method=config.init_method, gather_output=False, bias=bias,
                                        skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1",
                                        tp_group=tp_group)
            width, channels = config.linear_conv_kernel_dim, self.conv_dim_local_tp
            self.conv1d = torch.nn.Conv1d(channels, channels, width, groups=channels, bias=conv_bias,
                                          padding=width - 1, dtype=config.params_dtype)
            self.dt_bias = torch.nn.Parameter(torch.ones(self.hv_tp, dtype=config.params_dtype))
            low, high = A_init_range
            self.A_log = torch.nn.Parameter(torch.empty(self.hv_tp, dtype=config.params_dtype)
                                            .uniform_(low, high).log())
            for param in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log):
                if param is not None:  # split over TP by head, as megatron-core marks them
                    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
            self.out_norm = build_module(submodules.out_norm, config=config, hidden_size=self.dv,
                                         eps=config.layernorm_epsilon)
            if getattr(self.out_norm, "zero_centered", False):  # the gated norm scales by its weight as stored
                self.out_norm.zero_centered = False  # (Qwen3.5's other norms by 1 + weight; _gated_norm reads it)
                with torch.no_grad():
                    self.out_norm.weight.fill_(1.0)
            for param in self.out_norm.parameters():  # summed over TP in _gated_norm's backward instead
                param.sequence_parallel = False
            self.out_proj = build_module(submodules.out_proj, self.v_dim, config.hidden_size, config=config,
                                         init_method=config.output_layer_init_method, bias=bias,
                                         input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                         tp_comm_buffer_name="fc2", tp_group=tp_group)

        def _cp(self, packed_seq_params):
            group = getattr(packed_seq_params, "cp_group", None) or self.cp_group
            if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
                return None, 1, 0
            size = dist.get_world_size(group)
            if self.hk_tp % size:
                raise ValueError(f"context parallelism of the linear-attention layers splits heads: "
                                 f"linear_num_key_heads ({self.num_key_heads}) / tensor_model_parallel_size "
                                 f"({self.tp_size}) must be a multiple of context_parallel_size ({size}).")
            return group, size, dist.get_rank(group)

        def _channels(self, cp: int, cp_rank: int) -> Tensor:
            """conv1d channels of head group ``cp_rank`` of ``cp``: its q, k and v heads."""
            q_w, v_w = self.hk_tp * self.dk // cp, self.hv_tp * self.dv // cp
            qk_local = self.hk_tp * self.dk
            parts = [torch.arange(q_w) + cp_rank * q_w, torch.arange(q_w) + qk_local + cp_rank * q_w,
                     torch.arange(v_w) + 2 * qk_local + cp_rank * v_w]
            return torch.cat(parts).to(self.conv1d.weight.device)

        def _mix(self, qkv: Tensor, b: Tensor, a: Tensor, cu, cu_pad, cp: int, cp_rank: int) -> Tensor:
            """Conv1d and the delta rule on whole sub-sequences (global order) of this rank's heads."""
            hk, hv = self.hk_tp // cp, self.hv_tp // cp
            channels = self._channels(cp, cp_rank) if cp > 1 else slice(None)
            heads = slice(cp_rank * hv, (cp_rank + 1) * hv)
            bias = self.conv1d.bias[channels] if self.conv1d.bias is not None else None
            qkv = packed_causal_conv1d(qkv, self.conv1d.weight[channels, 0], bias, cu, cu_pad,
                                       activation=self.config.activation_func)
            q, k, v = qkv.split([hk * self.dk, hk * self.dk, hv * self.dv], dim=-1)
            g = -self.A_log[heads].float().exp() * F.softplus(a.float() + self.dt_bias[heads])
            out = packed_gated_delta_rule(q.reshape(-1, hk, self.dk), k.reshape(-1, hk, self.dk),
                                          v.reshape(-1, hv, self.dv), g, b.sigmoid(), cu, cu_pad,
                                          kernel=self.kernel, use_qk_l2norm=self.use_qk_l2norm)
            return out.reshape(out.size(0), -1)

        def _core(self, mixed: Tensor, cu, cu_pad, packed_seq_params) -> tuple[Tensor, Tensor]:
            """mixed [T_local, in_proj_dim] -> (delta-rule output [T_local, v_dim], gate z [T_local, v_dim])."""
            qk, v_dim, hv = self.hk_tp * self.dk, self.hv_tp * self.dv, self.hv_tp
            qkv, z, b, a = mixed.split([2 * qk + v_dim, v_dim, hv, hv], -1)
            group, cp, cp_rank = self._cp(packed_seq_params)
            if cp == 1:
                return self._mix(qkv, b, a, cu, cu_pad, 1, 0), z
            q, k, v = qkv.split([qk, qk, v_dim], dim=-1)
            rows = mixed.size(0)
            local = torch.cat([t.reshape(rows, cp, -1) for t in (q, k, v, b, a)], dim=-1)  # [T/CP, CP, w]
            full = sequence_to_heads(local, cu_pad, group)
            hk, hv = self.hk_tp // cp, self.hv_tp // cp
            qkv_g, b_g, a_g = full.split([2 * hk * self.dk + hv * self.dv, hv, hv], dim=-1)
            out = self._mix(qkv_g, b_g, a_g, cu, cu_pad, cp, cp_rank)
            return heads_to_sequence(out, cu_pad, group, cp).reshape(rows, -1), z

        def forward(self, hidden_states: Tensor, attention_mask=None, key_value_states=None,
                    inference_context=None, attention_bias=None, packed_seq_params=None, sequence_len_offset=None,
                    **kwargs):
            if inference_context is not None or kwargs.get("inference_params") is not None:
                raise NotImplementedError("PackedGatedDeltaNet is a training layer: no inference cache.")
            mixed, _ = self.in_proj(hidden_states)  # [s, b, in_proj_dim]
            seq, batch = mixed.shape[:2]
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                if batch != 1:
                    raise ValueError(f"THD packs have micro-batch size 1; got hidden states "
                                     f"{tuple(hidden_states.shape)}.")
                cu = packed_seq_params.cu_seqlens_q
                cu_pad = packed_seq_params.cu_seqlens_q_padded
                cu_pad = cu if cu_pad is None else cu_pad
            else:  # SBHD: each column one whole sequence of s * CP tokens
                _, cp, _ = self._cp(packed_seq_params)
                cu = cu_pad = torch.arange(batch + 1) * seq * cp
            flat = mixed.transpose(0, 1).reshape(batch * seq, -1)
            core, z = self._core(flat, cu, cu_pad, packed_seq_params)
            normed = self._gated_norm(core.reshape(-1, self.dv), z.reshape(-1, self.dv))
            return self.out_proj(normed.reshape(batch, seq, -1).transpose(0, 1).contiguous())

        def _gated_norm(self, x: Tensor, gate: Tensor) -> Tensor:
            """RMSNorm over each head's ``dv`` channels (one weight shared by every head), times act(gate).

            Each TP rank norms only its heads, so the weight's gradient is a partial sum: the weight goes
            through ``_SumGradOverTP`` (its backward all-reduces over TP; 0.16.1's ``finalize_model_grads``
            sums norm weights over TP only under sequence parallelism)."""
            norm = self.out_norm
            if not hasattr(norm, "weight") or getattr(norm, "bias", None) is not None:
                raise ValueError("PackedGatedDeltaNet's out_norm must be an RMSNorm (a weight, no bias).")
            weight = _SumGradOverTP.apply(norm.weight, self.tp_group) if self.tp_size > 1 else norm.weight
            y = F.rms_norm(x.float(), (self.dv,), weight.float(), norm.eps)
            return (y * self.config.activation_func(gate.float())).to(x.dtype)

    PackedGatedDeltaNet.__module__ = __name__
    return PackedGatedDeltaNet


_CLASS: list = []


def __getattr__(name: str):
    # built on first use, so ``delta_rule`` and this module import without megatron-core (as attention.py)
    if name == "PackedGatedDeltaNet":
        if not _CLASS:
            _CLASS.append(_gdn_class())
        return _CLASS[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def linear_attention_spec():
    """``ModuleSpec`` of ``PackedGatedDeltaNet`` with megatron-core's local linears and our SP-capable norm."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_pack.model.norms import SequenceParallelNorm

    return ModuleSpec(module=__getattr__("PackedGatedDeltaNet"), submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=SequenceParallelNorm, out_proj=RowParallelLinear))


def linear_attention_layer_spec(full_attention_layer_spec):
    """A ``TransformerLayer`` spec like ``full_attention_layer_spec`` (e.g. one of ``builder.local_block_spec``'s
    layer specs) with its self-attention replaced by the packed Gated DeltaNet: the hybrid stack's
    ``linear_attention`` layers (Qwen3.5's ``layer_types``)."""
    import copy

    spec = copy.copy(full_attention_layer_spec)
    spec.submodules = copy.copy(full_attention_layer_spec.submodules)
    spec.submodules.self_attention = linear_attention_spec()
    return spec
