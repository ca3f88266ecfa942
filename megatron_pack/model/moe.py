"""Mixture-of-experts layers on packed THD batches: routing that never sees padding, per-sample aux losses.

megatron-core's ``MoELayer`` (router, token dispatcher, ``SequentialMLP`` experts) with a layer and a router of
ours (``model/moe_router.py``). The pack's boundaries (metadata, never token ids) reach them as an argument of the
model's forward, as megatron-core's padding mask does: ``training.step.model_inputs`` passes the **routing index**
(:func:`routing_index`: the sub-sequence of each position, -1 on padding) as ``padding_mask``, megatron-core carries
it down to each MoE layer (and scatters it under sequence parallelism), and the layer hands it to its router for
that call. A recomputed forward (``model.recompute_granularity``) replays the same arguments, so it routes the
micro-batch it recomputes, not the one the pipeline schedule ran last:

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
  losses, summed over the step's micro-batches in each router (:class:`PackRouting`, on the device: no host sync per
  router forward; a recomputed forward records nothing), reach the host once per step (:func:`stage_moe_reports`)
  and join the step outcome's reduction over DP x CP; with pipeline stages each stage brings its own layers
  (``training.outcome.step_outcome``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Mapping, Optional, Sequence

import torch

from megatron_pack.config.layout import pad_multiple
from megatron_pack.parallel.comm import all_reduce
from megatron_pack.parallel.groups import at_teardown

LAYER_REPORT = "moe layer "
"""Prefix of a MoE layer's step report, ``"moe layer 3"``: [sum of n_s * L_s, sum of n_s * Z_s, routed tokens per
expert...], summed over the step's micro-batches (and then DP x CP)."""


@dataclass
class PackRouting:
    """The routers' step settings (coefficients, ``step_scale``) and what they recorded (``load`` of the latest
    forward, ``step`` over the step); the micro-batch's boundaries are not here but in the forward's argument
    (module docstring)."""

    load: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer number -> tokens routed to each expert on this rank by the latest forward (real tokens only)."""
    step: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer number -> float64 [weighted aux loss, weighted z-loss, tokens per expert...] of this rank (its local
    part), summed over the step's forwards (cleared by :func:`set_step_tokens`)."""
    aux_coeff: float = 0.0
    """model.moe_aux_loss_coeff."""
    z_coeff: float = 0.0
    """model.moe_z_loss_coeff."""
    step_scale: float = 1.0
    """Global target tokens / global real tokens of the current step (``set_step_tokens``): what turns the
    per-real-token auxiliary losses into the per-target-token units ``finalize_model_grads`` divides."""

    def record(self, layer: int, record: torch.Tensor) -> None:
        """A router's forward: ``record`` float64 [aux, z, tokens per expert...] (this rank's part)."""
        self.load[layer] = record[2:]
        self.step[layer] = record if layer not in self.step else self.step[layer] + record


def routing_index(batch: Mapping[str, Any], cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 [1, T_local]: the sub-sequence of each of this CP rank's positions, -1 on padding.

    From the pack's metadata only (``cu_seqlens``, ``cu_seqlens_padded``). Sub-sequences are numbered in order,
    counting only those that hold positions (a fixed ``cu_seqlens`` tail of zero-length entries holds none), so an
    index is below ``T / pad_multiple`` (:func:`max_sub_sequences`). Example: ``cu_seqlens=[0, 3, 5]``,
    ``cu_seqlens_padded=[0, 4, 8]``, CP=1 -> ``[[0, 0, 0, -1, 1, 1, -1, -1]]``; CP=2 rank 1 -> ``[[0, 0, 1, -1]]``.
    """
    from megatron_pack.parallel.cp import thd_local_segments

    cu = torch.as_tensor(batch["cu_seqlens"]).reshape(-1).to(torch.int64)
    padded = torch.as_tensor(batch["cu_seqlens_padded"]).reshape(-1).to(torch.int64)
    num_local = int(padded[-1]) // cp_size
    seq, real = thd_local_segments(cu, padded, num_local, cp_size, cp_rank)
    numbered = torch.cumsum(padded[1:] > padded[:-1], 0) - 1  # sub-sequence -> its number among those with rows
    return torch.where(real, numbered[seq], torch.full_like(seq, -1)).unsqueeze(0)


def max_sub_sequences(num_tokens: int, cp_size: int, tp_size: int, sequence_parallel: bool) -> int:
    """An upper bound of the sub-sequences with positions in a pack of ``num_tokens`` (all CP ranks' positions):
    each holds a multiple of the layout's ``pad_multiple`` (the collate pads every sub-sequence to it), so at most
    ``num_tokens // pad_multiple``. At CP > 1 or under sequence parallelism that is at most one router's own token
    count, so the per-sample counts the routers all-reduce are no larger than the routing map."""
    return max(1, num_tokens // pad_multiple(cp_size, tp_size, sequence_parallel))


def step_token_counts(batches: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """(target tokens, real tokens) of whole packs ``batches``, from their metadata (``loss_mask``, ``cu_seqlens``)."""
    target = sum(float(torch.as_tensor(b["loss_mask"]).sum()) for b in batches)
    real = sum(float(torch.as_tensor(b["cu_seqlens"]).reshape(-1)[-1]) for b in batches)
    return target, real


def set_step_tokens(model, batches: Sequence[Mapping[str, Any]], dp_group=None) -> Optional[tuple[float, float]]:
    """Before a step's forward: sum the step's target and real tokens over ``dp_group`` (``batches``: this DP
    rank's whole packs, every micro-batch; the CP ranks of a DP rank read the same packs), give the routers of
    ``model`` (a model chunk, or the list of this rank's chunks: virtual pipeline stages) ``step_scale = M / N``
    (module docstring) and clear their step records. Returns the global ``(M, N)``; None (no collective) for a
    dense model. Every rank of ``dp_group`` calls it, whatever its packs hold."""
    routings = [r for r in map(pack_routing, model if isinstance(model, (list, tuple)) else [model]) if r is not None]
    if not routings:
        return None
    counts = torch.tensor(step_token_counts(batches), dtype=torch.float64)
    if dp_group is not None:
        all_reduce(counts, group=dp_group)
    target, real = float(counts[0]), float(counts[1])
    for routing in routings:
        routing.step_scale = target / real if real > 0 else 0.0
        routing.step.clear()
    return target, real


def pack_routing(model) -> Optional[PackRouting]:
    """The ``PackRouting`` the routers of ``model`` (a GPTModel, or wrapped) read; None for a dense model."""
    while hasattr(model, "module"):
        model = model.module
    return getattr(model, "pack_routing", None)


def begin_micro_batch(model, batch: Mapping[str, Any], cp_size: int, cp_rank: int, device) -> Optional[torch.Tensor]:
    """Before a micro-batch's forward: the routing index of ``batch`` (the whole pack; :func:`routing_index`) on
    ``device``, which the forward takes as its ``padding_mask``; None for a dense model. The routers' ``load`` of
    the previous forward is cleared."""
    routing = pack_routing(model)
    if routing is None:
        return None
    routing.load.clear()
    return routing_index(batch, cp_size, cp_rank).to(device)


def stage_moe_reports(model_chunks: Sequence) -> dict[str, list[float]]:
    """This rank's step records of every MoE layer of its chunks, ``{"moe layer N": [aux, z, load...]}`` (one host
    transfer per step); {} for a dense model or a step that ran no forward."""
    records = {layer: record for chunk in model_chunks if (routing := pack_routing(chunk)) is not None
               for layer, record in routing.step.items()}
    if not records:
        return {}
    layers = sorted(records)
    values = torch.stack([records[layer] for layer in layers]).cpu().tolist()
    return {f"{LAYER_REPORT}{layer}": row for layer, row in zip(layers, values)}


def per_sample_aux_losses(logits: torch.Tensor, routing_map: torch.Tensor, seq: torch.Tensor, *, topk: int,
                          num_seqs: int, group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's part of sum_s n_s * L_s, of sum_s n_s * Z_s, tokens per expert) (module docstring: each sample
    weighs as many real tokens ``n_s`` as it has).

    ``logits`` [T, E] router logits, ``routing_map`` [T, E] (False on padding), ``seq`` [T] sub-sequence or -1
    (:func:`routing_index`), ``num_seqs`` a bound of the sub-sequences (every index below it; the same on every
    rank of ``group``); ``group`` the other ranks holding parts of the same sub-sequences (CP, and TP with sequence
    parallelism): the counts ``c_se`` and ``n_s`` are summed over it (every rank enters the all-reduce, whatever its
    slice holds). Rows of the bound that no sub-sequence uses count zero.
    """
    num_experts = logits.shape[-1]
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
    safe_n = n_s.clamp(min=1)
    # n_s * L_s = n_s * E / (k n_s^2) * sum_e c_se P_se
    aux = (num_experts / (topk * safe_n) * (c_se * p_se).sum(-1)).sum()
    # n_s * Z_s = the sum of logsumexp^2 over the sample's real tokens: this rank's part needs no count
    z = (torch.logsumexp(logits.float(), dim=-1).square() * real).sum()
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
    routers = [m for m in model.modules() if hasattr(m, "pack") and hasattr(m, "topk")]  # model/moe_router.py's
    if not routers:
        return None
    routing = PackRouting(aux_coeff=model_cfg.moe_aux_loss_coeff, z_coeff=model_cfg.moe_z_loss_coeff)
    for router in routers:
        router.pack = routing
    model.pack_routing = routing
    at_teardown(partial(_drop_dispatched_probs, weakref.ref(model)))
    return routing


def _drop_dispatched_probs(model_ref) -> None:
    """At the layout's end (``parallel.groups.destroy_parallel``): drop the routing probabilities megatron-core's
    all-to-all dispatcher keeps from the model's last forward. Their autograd graph reaches the parameters'
    gradient accumulators, whose DDP hooks hold the DDP and the model: a cycle through autograd nodes that the
    garbage collector cannot follow, so the model and every process group it holds (each gloo group's 3 threads
    wake while idle) outlived the layout: 16 groups a MoE layout in a 2-rank world."""
    model = model_ref()
    for module in model.modules() if model is not None else ():
        dispatcher = getattr(module, "token_dispatcher", None)
        if getattr(dispatcher, "probs", None) is not None:
            dispatcher.probs = None


def step_moe_metrics(reports: Mapping[str, Sequence[float]], real_tokens: float,
                     num_experts: Optional[int]) -> Optional[dict]:
    """The step's MoE numbers over the global batch (None for a dense model), from ``reports``: the layers' step
    records (:func:`stage_moe_reports`) summed over DP x CP, every pipeline stage's layers
    (``training.outcome.StepOutcome.reports``); ``real_tokens`` the global batch's (``N``).

    ``load_balancing_loss`` and ``z_loss`` are per layer (the mean over MoE layers) and per real token
    (``sum_s n_s * L_s / N``, the module docstring), so the objective holds ``coeff * num_layers * value``;
    ``tokens_per_expert`` is [layer][expert] in layer order (real tokens routed, each counted top-k times) and
    ``max_over_mean_load`` per layer (1.0: perfectly balanced).
    """
    layers = sorted((int(name[len(LAYER_REPORT):]), values) for name, values in reports.items()
                    if name.startswith(LAYER_REPORT))
    if not num_experts or not layers:
        return None
    table = torch.tensor([values for _, values in layers], dtype=torch.float64)
    load = table[:, 2:]
    aux, z = float(table[:, 0].sum()), float(table[:, 1].sum())
    per = max(real_tokens, 1.0) * load.shape[0]
    mean = load.mean(-1).clamp(min=1e-12)
    return {"load_balancing_loss": aux / per, "z_loss": z / per,
            "tokens_per_expert": load.round().long().tolist(),
            "max_over_mean_load": (load.max(-1).values / mean).tolist()}
