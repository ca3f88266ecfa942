"""Model FLOPs of a packed step, and MFU: the throughput a run reports, counting what the step computes.

A pack of sub-sequences of real lengths ``s_1 .. s_N`` (padding excluded) costs, per layer, forward
(a multiply-add is 2 FLOPs; ``h`` hidden, ``a`` = heads x kv_channels, ``g`` = query groups x kv_channels,
``f`` the MLP inner width, ``V`` the vocabulary)::

    projections  2 * (h * (a + 2g) + a * h) * sum(s_i)          QKV and the output projection
    attention    2 * a * sum(s_i^2)                              QK^T and AV over the causal half:
                                                                 4 * a * s_i^2 / 2 per sub-sequence
    MLP          2 * (3 if SwiGLU else 2) * h * f * sum(s_i)     fc1 (gate and up) and fc2
    MoE MLP      2 * h * E * sum(s_i) (router) + top-k experts' MLPs (+ a shared expert's) per token
    gate         2 * h * a * sum(s_i) with model.attention_output_gate (linear_qkv's gate rows)

A hybrid stack's Gated DeltaNet layers (all but every model.full_attention_interval-th) replace the projections
and the attention term by their own token mixing, linear in s_i (``_linear_attention_flops_per_token``).

Once per token, the output layer ``2 * h * V * sum(s_i)``. The attention term is the sum of ``s_i^2`` over
the pack's sub-sequences (each attends only within itself), not ``T^2`` over the pack. Forward and
backward are ``3 x`` the forward (the backward computes two GEMMs per forward GEMM); activation
recomputation is not counted (it is not model work). Worked example, the tiny preset (h 64, 4 heads of
16, 2 groups, SwiGLU f 176, V 384, 2 layers), one pack of sub-sequences 3 and 5 (8 real tokens):
per layer 2*(64*(64+64) + 64*64)*8 + 2*64*(9+25) + 6*64*176*8 = 196608 + 4352 + 540672 = 741632,
two layers 1483264, output 2*64*384*8 = 393216: forward 1876480, step 3 x = 5629440 FLOPs.

MFU is the model FLOP/s per device over the device's peak: the dense bf16 tensor-core peak of the GPU
(``PEAK_TFLOPS``, by the name torch reports) or ``train.peak_tflops``; on a CPU only with
``train.peak_tflops``.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_pack.config.choices import GATED_ACTIVATIONS
from megatron_pack.config.schema import ModelConfig

PEAK_TFLOPS = (
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0),
    ("B200", 2250.0), ("GB200", 2500.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0),
    ("A10G", 70.0), ("A10", 125.0), ("MI300X", 1307.0), ("MI250X", 383.0),
)
"""Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) of common GPUs, matched in order against
``torch.cuda.get_device_name`` (the first name it contains: 'H100 PCIe' before 'H100', 'A10G' before 'A10')."""


def sum_sq_seqlens(cu_seqlens: torch.Tensor) -> int:
    """Sum of the squared real lengths of a pack's sub-sequences (``cu_seqlens``: cumulative real lengths).

    >>> sum_sq_seqlens(torch.tensor([0, 3, 8, 8]))   # sub-sequences 3 and 5, a zero-length tail
    34
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return int((lengths * lengths).sum())


def _mlp_flops_per_token(m: ModelConfig, inner: int) -> int:
    return 2 * (3 if m.activation in GATED_ACTIVATIONS else 2) * m.hidden_size * inner


def forward_flops(m: ModelConfig, real_tokens: float, sum_sq: float) -> float:
    """Forward FLOPs of ``real_tokens`` tokens whose sub-sequences' squared lengths sum to ``sum_sq``."""
    h = m.hidden_size
    kv = m.kv_channels or h // m.num_attention_heads
    a, g = m.num_attention_heads * kv, (m.num_query_groups or m.num_attention_heads) * kv
    per_token = 2 * (h * (a + 2 * g) + a * h)
    if m.num_experts:
        per_token += 2 * h * m.num_experts + m.moe_router_topk * _mlp_flops_per_token(
            m, m.moe_ffn_hidden_size or m.ffn_hidden_size)
        if m.moe_shared_expert_ffn_hidden_size:
            per_token += _mlp_flops_per_token(m, m.moe_shared_expert_ffn_hidden_size)
            per_token += 2 * h if m.moe_shared_expert_gate else 0
    else:
        per_token += _mlp_flops_per_token(m, m.ffn_hidden_size)
    if m.attention_output_gate:  # linear_qkv also projects a gate per query channel
        per_token += 2 * h * a
    full = m.num_layers if m.full_attention_interval is None else m.num_layers // m.full_attention_interval
    layers = full * (per_token * real_tokens + 2 * a * sum_sq)
    linear = (per_token - 2 * (h * (a + 2 * g) + a * h) - (2 * h * a if m.attention_output_gate else 0)
              + _linear_attention_flops_per_token(m))
    return float(layers + (m.num_layers - full) * linear * real_tokens + 2 * h * m.vocab_size * real_tokens)


def _linear_attention_flops_per_token(m: ModelConfig) -> int:
    """A Gated DeltaNet layer's token mixing, per token (``model.full_attention_interval``'s linear layers):
    in_proj 2 h (2 qk + 2 v + 2 Hv) and out_proj 2 v h, the conv1d 2 W (2 qk + v), and the delta rule in its
    recurrent form, per value head S^T k, the rank-1 update and S^T q: 3 x 2 dk dv (its chunked form computes the same
    up to the intra-chunk terms, not counted). qk = key heads x dk, v = value heads (Hv) x dv, W the conv width."""
    h, dk, dv, hv = m.hidden_size, m.linear_key_head_dim, m.linear_value_head_dim, m.linear_num_value_heads
    qk, v = m.linear_num_key_heads * dk, hv * dv
    return 2 * h * (2 * qk + 2 * v + 2 * hv) + 2 * v * h + 2 * m.linear_conv_kernel_dim * (2 * qk + v) + 6 * hv * dk * dv


def step_flops(m: ModelConfig, real_tokens: float, sum_sq: float) -> float:
    """Forward and backward: 3 x the forward."""
    return 3.0 * forward_flops(m, real_tokens, sum_sq)


def device_peak_tflops(device: torch.device, configured: Optional[float]) -> Optional[float]:
    """``train.peak_tflops`` when set; else the table's peak for this GPU (None: a CPU, or a GPU not listed)."""
    if configured is not None:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def throughput(m: ModelConfig, *, real_tokens: float, sum_sq: float, step_time_s: float, world_size: int,
               peak_tflops: Optional[float]) -> tuple[float, Optional[float]]:
    """(model TFLOP/s per device, MFU or None without a peak) of one step over ``world_size`` devices."""
    if step_time_s <= 0:
        return 0.0, None
    per_device = step_flops(m, real_tokens, sum_sq) / world_size / step_time_s / 1e12
    return per_device, (per_device / peak_tflops if peak_tflops else None)
