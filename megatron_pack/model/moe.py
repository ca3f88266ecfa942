"""Mixture-of-experts layers on packed THD batches: routing that never sees padding, per-sample aux losses.

megatron-core's ``MoELayer`` (router, token dispatcher, ``SequentialMLP`` experts) with one router
of ours, ``PackedTopKRouter`` (``model/moe_router.py``), which reads the pack's boundaries (metadata, never token ids) from
``PackRouting``, set by ``training.step.forward_step`` before every forward:

* **padding is not routed**: a padding position (each sub-sequence's THD padding, the tail, a CP
  rank's padding-only slice) gets no expert (its routing-map row is all False, its probabilities
  0), so it takes no expert's compute, counts in no expert's load and in no auxiliary loss. The
  MoE output there is 0 (its residual stream is never a target). Routing is dropless (no expert
  capacity), so nothing real is dropped either.
* **load-balancing loss, per sample**: sample ``s`` with ``n_s`` real tokens gets the Switch
  loss of that sample alone, ``L_s = E / (k * n_s^2) * sum_i c_si * P_si`` (``c_si`` its tokens
  routed to expert i, ``P_si`` the sum of its tokens' softmax probability of expert i): exactly
  the loss the sample would get as its own unpacked batch of one sequence. ``c_si`` and ``n_s``
  are summed over the ranks holding the sample's tokens (CP, and TP under sequence parallelism),
  so ``L_s`` does not depend on the layout.
* **per real token over the global batch**: "unpacked" is each sample of the step run alone as its
  own sequence; the step's auxiliary losses are the real-token-weighted means over every sample of
  the global batch (all DP ranks, CP ranks and micro-batches), ``LB = sum_s n_s * L_s / N`` and
  ``ZL = sum_s n_s * Z_s / N`` with ``N`` the global batch's real tokens (``Z_s`` the router z-loss,
  the mean over the sample's real tokens of ``logsumexp(router logits)^2``, so ``ZL`` is the plain
  mean over every real token of the batch). The step minimises ``sum_t lm_t / M + a * LB + z * ZL``
  (per MoE layer, summed over layers), ``M`` the global target tokens. The one normalisation,
  ``finalize_model_grads``, scales every gradient by ``1 / M``, so each router attaches
  ``(M / N) * (a * sum_s n_s L_s + z * sum_s n_s Z_s)`` (its local part): ``M`` and ``N`` come from the
  step's boundary metadata before the forward (:func:`set_step_tokens`, one all-reduce over DP).
* **metrics**: tokens routed to each expert of each layer (real tokens only) and the two auxiliary
  losses go into the loss report (``report["moe ..."]``), summed over the step like the LM loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from megatron_pack.parallel.comm import all_reduce

AUX_REPORT, Z_REPORT, LOAD_REPORT = "moe load balancing loss", "moe z loss", "moe tokens per expert"
"""Keys of the loss report: [sum of n_s * L_s], [sum of n_s * Z_s], [layers, experts] routed-token counts."""


@dataclass
class PackRouting:
    """What the routers of one model read about the current micro-batch (set by ``set_pack``)."""

    seq_index: Optional[torch.Tensor] = None
    """int64 [T_local]: the sub-sequence of each local position, -1 on padding."""
    seq_weight: Optional[torch.Tensor] = None
    """float [N]: real tokens of each sub-sequence (the weight of its auxiliary losses)."""
    aux: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer number -> this micro-batch's detached [weighted aux loss, weighted z-loss] (local part)."""
    load: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer number -> tokens routed to each expert on this rank, real tokens only."""
    aux_coeff: float = 0.0
    """model.moe_aux_loss_coeff."""
    z_coeff: float = 0.0
    """model.moe_z_loss_coeff."""
    step_scale: float = 1.0
    """Global target tokens / global real tokens of the current step (``set_step_tokens``): what turns the
    per-real-token auxiliary losses into the per-target-token units ``finalize_model_grads`` divides."""


def sequence_layout(batch: Mapping[str, Any], cp_size: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sub-sequence of each of this CP rank's positions, -1 on padding; real tokens per sub-sequence).

    From the pack's metadata only (``cu_seqlens``, ``cu_seqlens_padded``). Example:
    ``cu_seqlens=[0, 3, 5]``, ``cu_seqlens_padded=[0, 4, 8]``, CP=1 ->
    ``([0, 0, 0, -1, 1, 1, -1, -1], [3., 2.])``.
    """
    from megatron_pack.parallel.cp import thd_local_segments

    cu = torch.as_tensor(batch["cu_seqlens"]).reshape(-1).to(torch.int64)
    padded = torch.as_tensor(batch["cu_seqlens_padded"]).reshape(-1).to(torch.int64)
    num_local = int(padded[-1]) // cp_size
    seq, real = thd_local_segments(cu, padded, num_local, cp_size, cp_rank)
    seq_index = torch.where(real, seq, torch.full_like(seq, -1))
    return seq_index, (cu[1:] - cu[:-1]).to(torch.float64)


def step_token_counts(batches: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """(target tokens, real tokens) of whole packs ``batches``, from their metadata (``loss_mask``, ``cu_seqlens``)."""
    target = sum(float(torch.as_tensor(b["loss_mask"]).sum()) for b in batches)
    real = sum(float(torch.as_tensor(b["cu_seqlens"]).reshape(-1)[-1]) for b in batches)
    return target, real


def set_step_tokens(model, batches: Sequence[Mapping[str, Any]], dp_group=None) -> Optional[tuple[float, float]]:
    """Before a step's forward: sum the step's target and real tokens over ``dp_group`` (``batches``: this DP
    rank's whole packs, every micro-batch; the CP ranks of a DP rank read the same packs) and give the routers
    ``step_scale = M / N`` (module docstring). Returns the global ``(M, N)``; None (no collective) for a dense
    model. Every rank of ``dp_group`` calls it, whatever its packs hold."""
    routing = pack_routing(model)
    if routing is None:
        return None
    counts = torch.tensor(step_token_counts(batches), dtype=torch.float64)
    if dp_group is not None:
        all_reduce(counts, group=dp_group)
    target, real = float(counts[0]), float(counts[1])
    routing.step_scale = target / real if real > 0 else 0.0
    return target, real


def pack_routing(model) -> Optional[PackRouting]:
    """The ``PackRouting`` the routers of ``model`` (a GPTModel, or wrapped) read; None for a dense model."""
    while hasattr(model, "module"):
        model = model.module
    return getattr(model, "pack_routing", None)


def set_pack(model, batch: Mapping[str, Any], cp_size: int, cp_rank: int, device) -> Optional[torch.Tensor]:
    """Point ``model``'s routers at ``batch`` (the whole pack); returns the padding mask [1, T_local]
    (True on padding) that megatron-core's MoE layer takes, or None for a dense model."""
    routing = pack_routing(model)
    if routing is None:
        return None
    seq_index, weight = sequence_layout(batch, cp_size, cp_rank)
    routing.seq_index, routing.seq_weight = seq_index.to(device), weight.to(device)
    routing.aux.clear()
    routing.load.clear()
    return (seq_index < 0).unsqueeze(0).to(device)


def moe_report(model, report: dict) -> dict:
    """``report`` plus this micro-batch's auxiliary losses and expert loads (summed over layers / stacked)."""
    routing = pack_routing(model)
    if routing is None or not routing.load:
        return report
    layers = sorted(routing.load)
    aux = torch.stack([routing.aux[i] for i in layers]).sum(0) if routing.aux else torch.zeros(2)
    report = dict(report)
    report[AUX_REPORT], report[Z_REPORT] = aux[0:1].float(), aux[1:2].float()
    report[LOAD_REPORT] = torch.stack([routing.load[i] for i in layers]).float()
    return report


def per_sample_aux_losses(logits: torch.Tensor, routing_map: torch.Tensor, seq: torch.Tensor, weight: torch.Tensor,
                          *, topk: int, group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's part of sum_s w_s * L_s, of sum_s w_s * Z_s, tokens per expert) (module docstring; the
    trainer's ``w_s`` is the sample's real tokens ``n_s``).

    ``logits`` [T, E] router logits, ``routing_map`` [T, E] (False on padding), ``seq`` [T] sub-sequence
    or -1, ``weight`` [N] the weight of each sub-sequence; ``group`` the other ranks holding parts of the
    same sub-sequences (CP, and TP with sequence parallelism): counts are summed over it (every rank
    enters the all-reduce, whatever its slice holds).
    """
    num_seqs, num_experts = weight.numel(), logits.shape[-1]
    real = seq >= 0
    owner = seq.clamp(min=0)
    scores = torch.softmax(logits.float(), dim=-1) * real.unsqueeze(-1)
    routed = routing_map.to(torch.float32) * real.unsqueeze(-1)  # padding never counts, whatever the map says
    counts = torch.zeros(num_seqs, num_experts + 1, dtype=torch.float32, device=logits.device)
    counts[:, :num_experts].index_add_(0, owner, routed)
    counts[:, num_experts].index_add_(0, owner, real.to(torch.float32))
    if group is not None:
        all_reduce(counts, group=group)
    c_se, n_s = counts[:, :num_experts], counts[:, num_experts]
    p_se = torch.zeros(num_seqs, num_experts, dtype=scores.dtype, device=logits.device).index_add_(0, owner, scores)
    w = weight.to(scores.dtype)
    safe_n = n_s.clamp(min=1)
    aux = (w * num_experts / (topk * safe_n * safe_n) * (c_se * p_se).sum(-1)).sum()
    lse2 = torch.logsumexp(logits.float(), dim=-1).square() * real
    z = (w / safe_n * torch.zeros(num_seqs, dtype=lse2.dtype, device=logits.device).index_add_(0, owner, lse2)).sum()
    # the load is what the map routed (padding included, were any routed): a measurement, not a filtered count
    return aux, z, routing_map.to(torch.float32).sum(0)


def moe_config_kwargs(model_cfg) -> dict:
    """megatron-core's MoE settings for ``model.*`` ({} for a dense model).

    The auxiliary losses are ours (``PackedTopKRouter``), so megatron-core's own are off
    (load_balancing_type 'none', z-loss None); dropless (no capacity factor); megatron-core's all-to-all
    dispatcher on every device (it exchanges each rank's own token count, so the EP ranks' packs may differ in
    length, the normal case of variable packs; its CUDA streams are ``model/cpu_compat.py``'s item 6 on CPU).
    """
    m = model_cfg
    if not m.num_experts:
        return {}
    return {"num_moe_experts": m.num_experts, "moe_router_topk": m.moe_router_topk,
            "moe_ffn_hidden_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
            "moe_router_pre_softmax": m.moe_router_pre_softmax, "moe_router_score_function": "softmax",
            "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None,
            "moe_router_dtype": "fp32",
            "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": False,
            "moe_permute_fusion": False, "moe_router_fusion": False,
            "moe_shared_expert_intermediate_size": m.moe_shared_expert_ffn_hidden_size,
            "moe_shared_expert_gate": m.moe_shared_expert_gate}


def attach_pack_routing(model, model_cfg) -> Optional[PackRouting]:
    """Give every router of ``model`` one shared ``PackRouting`` (``model.pack_routing``); None when dense."""
    routers = [m for m in model.modules() if hasattr(m, "pack") and hasattr(m, "topk")]
    if not routers:
        return None
    routing = PackRouting(aux_coeff=model_cfg.moe_aux_loss_coeff, z_coeff=model_cfg.moe_z_loss_coeff)
    for router in routers:
        router.pack = routing
    model.pack_routing = routing
    return routing


def step_moe_metrics(reports: Mapping[str, Sequence[float]], real_tokens: float,
                     num_experts: Optional[int]) -> Optional[dict]:
    """The step's MoE numbers over the global batch (None for a dense model), from ``reports``: the
    loss reports summed by name over the micro-batches and DP x CP (``training.outcome.StepOutcome.reports``,
    whose one all-reduce carries them; ``[LOAD_REPORT]`` is flattened there, [layers x experts]);
    ``real_tokens`` the global batch's (``N``).

    ``load_balancing_loss`` and ``z_loss`` are per layer (the mean over MoE layers) and per real token
    (``sum_s n_s * L_s / N``, the module docstring), so the objective holds ``coeff * num_layers * value``;
    ``tokens_per_expert`` is [layer][expert] (real tokens routed, each counted top-k times) and
    ``max_over_mean_load`` per layer (1.0: perfectly balanced).
    """
    if not num_experts or LOAD_REPORT not in reports:
        return None
    load = torch.tensor(reports[LOAD_REPORT], dtype=torch.float64).reshape(-1, num_experts)
    aux, z = float(reports[AUX_REPORT][0]), float(reports[Z_REPORT][0])
    per = max(real_tokens, 1.0) * load.shape[0]
    mean = load.mean(-1).clamp(min=1e-12)
    return {"load_balancing_loss": aux / per, "z_loss": z / per,
            "tokens_per_expert": load.round().long().tolist(),
            "max_over_mean_load": (load.max(-1).values / mean).tolist()}
