"""``PackedMoELayer`` and ``PackedTopKRouter``: megatron-core's MoE layer and top-k router on packed THD batches
(``model/moe.py`` says what they do).

Their own module so that megatron-core is imported only when a MoE model is built (``moe_mlp_spec`` imports it),
while the classes themselves are defined once, at module level.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, topk_routing_with_score_function
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.moe.router import TopKRouter

from megatron_pack.model.moe import PackRouting, max_sub_sequences, per_sample_aux_losses
from megatron_pack.parallel.comm import all_reduce


class PackedMoELayer(MoELayer):
    """megatron-core's MoE layer whose ``padding_mask`` may be the pack's routing index (``model.moe.routing_index``:
    int64 [1, T], the sub-sequence of each position, -1 on padding). The layer gives megatron-core the padding mask
    it expects (True on padding) and its router the index, for the duration of this call only: a recomputed forward
    replays its own arguments. A boolean mask or None goes to megatron-core as is (no per-sample losses)."""

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        if padding_mask is None or padding_mask.dtype == torch.bool:
            return super().forward(hidden_states, intermediate_tensors, padding_mask=padding_mask)
        index = self._local_index(padding_mask.reshape(-1), hidden_states.shape[0] * hidden_states.shape[1])
        with self.router.routing_index(index):
            return super().forward(hidden_states, intermediate_tensors, padding_mask=(index < 0).unsqueeze(0))

    def _local_index(self, index: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """This TP rank's part of the index under sequence parallelism: megatron-core scatters ``padding_mask`` only
        where the tokens enter (the first pipeline stage, without ``decoder_input``); elsewhere it comes whole."""
        if index.numel() == num_tokens:
            return index
        tp_group = self.router.tp_group
        if index.numel() != num_tokens * tp_group.size():
            raise ValueError(f"MoE layer {self.layer_number}: a routing index of {index.numel()} positions for "
                             f"{num_tokens} tokens (TP {tp_group.size()}): the index must come from the same pack")
        rank = tp_group.rank()
        return index[rank * num_tokens:(rank + 1) * num_tokens]


class PackedTopKRouter(TopKRouter):
    """megatron-core's top-k router, with padding unrouted and the per-sample auxiliary losses of ``model/moe.py``."""

    pack: Optional[PackRouting] = None
    """The model's step settings and records (``model.moe.attach_pack_routing``)."""
    _index: Optional[torch.Tensor] = None
    """The routing index of the forward running now (``routing_index``), else None."""

    @contextlib.contextmanager
    def routing_index(self, index: torch.Tensor) -> Iterator[None]:
        """Route with the pack's routing ``index`` (this router's tokens) for the duration of the block."""
        outer, self._index = self._index, index
        try:
            yield
        finally:
            self._index = outer

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        # router logits in float32 (megatron-core's router_gating_linear names a Transformer
        # Engine GEMM that is undefined where TE is not installed); gpt-oss's router has a bias (add_bias_linear)
        bias = self.bias.float() if getattr(self, "bias", None) is not None else None
        return torch.nn.functional.linear(input.float(), self.weight.float(), bias)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        logits = logits.view(-1, self.config.num_moe_experts)
        pad = self._padding(logits, padding_mask)
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=self.config.moe_router_pre_softmax, score_function="softmax")
        routing_map = routing_map & ~pad.unsqueeze(-1)
        probs = probs * (~pad).unsqueeze(-1).to(probs.dtype)
        if self.pack is not None and self._index is not None:  # a forward of the trainer's or verify's step
            probs = self._attach_aux_losses(logits, probs, routing_map)
        return probs, routing_map

    def _padding(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
        if padding_mask is None:
            return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        return padding_mask.reshape(-1).to(torch.bool)

    def _attach_aux_losses(self, logits, probs, routing_map):
        seq = self._index
        group = self.tp_cp_group if self.tp_cp_group.size() > 1 else None
        config = self.config
        num_seqs = max_sub_sequences(seq.numel() * self.tp_cp_group.size(), config.context_parallel_size,
                                     config.tensor_model_parallel_size, config.sequence_parallel)
        aux, z, load = per_sample_aux_losses(logits, routing_map, seq, topk=self.topk, num_seqs=num_seqs, group=group)
        a, zc = self.pack.aux_coeff, self.pack.z_coeff
        record = torch.cat([torch.stack([aux.detach(), z.detach()]), load.detach()])
        if config.sequence_parallel and self.tp_group.size() > 1:  # TP ranks hold different tokens
            record = record.clone()
            all_reduce(record, group=self.tp_group)
        # stays on the device (no host sync per router forward): summed over the step, it reaches the host once a
        # step and joins the step outcome's one reduction (model.moe.stage_moe_reports). The recomputed forward of
        # a checkpointed layer (megatron-core's checkpoint: grad on, inside the checkpoint) repeats one already
        # recorded, so it records nothing
        if not (is_checkpointing() and torch.is_grad_enabled()):
            self.pack.record(self.layer_number, record.double())
        total = self.pack.step_scale * (a * aux + zc * z)
        if self.training and torch.is_grad_enabled() and (a or zc):
            probs = MoEAuxLossAutoScaler.apply(probs, total)
        return probs


def expert_output_linear_class() -> type:
    """megatron-core's ``RowParallelLinear`` for an expert's ``linear_fc2`` whose output is its own tensor.

    A biased expert (gpt-oss) adds its bias in place to that output (megatron-core's ``MLP.forward``:
    ``output += output_bias * probs``). Where the expert's linear has no expert communication (EP 1 and expert TP 1)
    megatron-core's TP reduce hands its input back as its output, a view autograd forbids changing in place; the
    copy is made only then (biased, training)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class ExpertOutputLinear(RowParallelLinear):
        def forward(self, input_):
            output, bias = super().forward(input_)
            if bias is not None and torch.is_grad_enabled() and not self.explicit_expert_comm:
                output = output.clone()
            return output, bias

    return ExpertOutputLinear


def moe_mlp_spec():
    """megatron-core's ``MoELayer`` spec with local linears (``SequentialMLP`` experts, a ``SharedExpertMLP``
    when ``moe_shared_expert_intermediate_size`` is set) and our router."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    experts = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=expert_output_linear_class())
    return ModuleSpec(module=PackedMoELayer, submodules=MoESubmodules(
        experts=ModuleSpec(module=SequentialMLP, submodules=experts),
        shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=linears), router=PackedTopKRouter))
