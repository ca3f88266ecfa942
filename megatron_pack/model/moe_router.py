"""``PackedTopKRouter``: megatron-core's top-k router on packed THD batches (``model/moe.py`` says what it does).

Its own module so that megatron-core is imported only when a MoE model is built (``moe_mlp_spec``
imports it), while the class itself is defined once, at module level.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter

from megatron_pack.model.moe import PackRouting, per_sample_aux_losses
from megatron_pack.parallel.comm import all_reduce


class PackedTopKRouter(TopKRouter):
    """megatron-core's top-k router, with padding unrouted and the per-sample auxiliary losses of ``model/moe.py``."""

    pack: Optional[PackRouting] = None

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        # router logits in float32 (megatron-core's router_gating_linear names a Transformer
        # Engine GEMM that is undefined where TE is not installed)
        return torch.nn.functional.linear(input.float(), self.weight.float())

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        logits = logits.view(-1, self.config.num_moe_experts)
        pad = self._padding(logits, padding_mask)
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=self.config.moe_router_pre_softmax, score_function="softmax")
        routing_map = routing_map & ~pad.unsqueeze(-1)
        probs = probs * (~pad).unsqueeze(-1).to(probs.dtype)
        if self.pack is not None and padding_mask is not None:  # a forward_step call (set_pack ran)
            probs = self._attach_aux_losses(logits, probs, routing_map)
        return probs, routing_map

    def _padding(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
        if padding_mask is None:
            return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        return padding_mask.reshape(-1).to(torch.bool)

    def _attach_aux_losses(self, logits, probs, routing_map):
        seq = self._local_seq_index(logits.shape[0])
        aux, z, load = per_sample_aux_losses(
            logits, routing_map, seq, self.pack.seq_weight, topk=self.topk,
            group=self.tp_cp_group if self.tp_cp_group.size() > 1 else None)
        a, zc = self.pack.aux_coeff, self.pack.z_coeff
        record = torch.cat([torch.stack([aux.detach(), z.detach()]), load.detach()])
        if self.config.sequence_parallel and self.tp_group.size() > 1:  # TP ranks hold different tokens
            record = record.clone()
            all_reduce(record, group=self.tp_group)
        # stays on the device (no host sync per router forward): the loss report carries it to the step's
        # one outcome reduction, where it reaches the host once per micro-batch
        record = record.double()
        self.pack.aux[self.layer_number], self.pack.load[self.layer_number] = record[:2], record[2:]
        total = self.pack.step_scale * (a * aux + zc * z)
        if self.training and torch.is_grad_enabled() and (a or zc):
            probs = MoEAuxLossAutoScaler.apply(probs, total)
        return probs

    def _local_seq_index(self, num_tokens: int) -> torch.Tensor:
        """The pack's per-position sub-sequences on this rank (the TP rank's part under sequence parallelism)."""
        seq = self.pack.seq_index
        if seq.numel() == num_tokens:
            return seq
        tp = self.tp_group.size()
        assert seq.numel() == num_tokens * tp, (seq.numel(), num_tokens, tp)
        rank = self.tp_group.rank()
        return seq[rank * num_tokens:(rank + 1) * num_tokens]


def moe_mlp_spec():
    """megatron-core's ``MoELayer`` spec with local linears (``SequentialMLP`` experts, a ``SharedExpertMLP``
    when ``moe_shared_expert_intermediate_size`` is set) and our router."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=ModuleSpec(module=SequentialMLP, submodules=linears),
        shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=linears), router=PackedTopKRouter))
