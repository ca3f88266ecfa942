"""Model FLOPs of a packed step counted by hand for the tiny model, and MFU against the device's peak."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_pack.config.schema import ModelConfig
from megatron_pack.training import flops

TINY = ModelConfig()  # 2 layers, hidden 64, 4 heads of 16, 2 query groups, SwiGLU 176, vocab 384


def _by_hand(m, lengths, *, experts=None):
    """The count written out independently: every GEMM of a layer as (rows, inner, cols), 2 FLOPs a multiply-add."""
    h, d, n_q, n_kv = m.hidden_size, m.hidden_size // m.num_attention_heads, m.num_attention_heads, m.num_query_groups
    total = 0
    for s in lengths:
        gemms = [(s, h, n_q * d), (s, h, n_kv * d), (s, h, n_kv * d), (s, n_q * d, h)]  # q, k, v, out
        if experts is None:
            gemms += [(s, h, m.ffn_hidden_size), (s, h, m.ffn_hidden_size), (s, m.ffn_hidden_size, h)]
        else:
            num_experts, topk, inner = experts
            gemms += [(s, h, num_experts)] + [(s, h, inner), (s, h, inner), (s, inner, h)] * topk
        per_layer = sum(2 * r * k * c for r, k, c in gemms)
        causal_pairs = s * s / 2  # each query attends to the keys up to itself: the causal half
        per_layer += n_q * (2 * causal_pairs * d) * 2  # QK^T and AV for every head
        total += m.num_layers * per_layer + 2 * s * h * m.vocab_size
    return 3 * total


def test_worked_example_of_the_docstring():
    # sub-sequences 3 and 5 (real lengths), a pack of 16 slots: the padding costs nothing
    cu = torch.tensor([0, 3, 8, 8])
    assert flops.sum_sq_seqlens(cu) == 34
    assert flops.forward_flops(TINY, 8, 34) == 1876480
    assert flops.step_flops(TINY, 8, 34) == 5629440 == _by_hand(TINY, [3, 5])


@pytest.mark.parametrize("lengths", [[512], [256, 256], [100, 7, 300, 1], [1] * 64], ids=["one", "two", "mixed", "ones"])
def test_attention_counts_each_sub_sequence_not_the_pack(lengths):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    sum_sq, real = flops.sum_sq_seqlens(cu), sum(lengths)
    assert flops.step_flops(TINY, real, sum_sq) == pytest.approx(_by_hand(TINY, lengths), rel=1e-12)
    if len(lengths) > 1:  # a pack of several sub-sequences costs less than one sequence of its length
        assert flops.step_flops(TINY, real, sum_sq) < flops.step_flops(TINY, real, real * real)


def test_moe_counts_the_top_k_experts_and_the_router():
    moe = dataclasses.replace(TINY, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
    assert flops.step_flops(moe, 8, 34) == _by_hand(moe, [3, 5], experts=(8, 2, 32))
    dense_mlp = flops.step_flops(TINY, 8, 34)
    assert flops.step_flops(moe, 8, 34) < dense_mlp  # 2 x 32-wide experts < one 176-wide MLP


@pytest.mark.parametrize("device,name,configured,expected", [
    ("cpu", None, None, None), ("cpu", None, 2.5, 2.5), ("cuda", "NVIDIA H100 80GB HBM3", None, 989.0),
    ("cuda", "NVIDIA H100 PCIe", None, 756.0), ("cuda", "NVIDIA H200", None, 989.0),
    ("cuda", "NVIDIA A100-SXM4-80GB", None, 312.0), ("cuda", "NVIDIA A10G", None, 70.0),
    ("cuda", "Some Future GPU", None, None), ("cuda", "NVIDIA H100 80GB HBM3", 500.0, 500.0),
], ids=["cpu", "cpu-configured", "h100", "h100-pcie", "h200", "a100", "a10g", "unknown", "configured-wins"])
def test_peak(monkeypatch, device, name, configured, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    assert flops.device_peak_tflops(torch.device(device), configured) == expected


def test_throughput_per_device_and_mfu():
    step = flops.step_flops(TINY, 8, 34)
    per_device, mfu = flops.throughput(TINY, real_tokens=8, sum_sq=34, step_time_s=0.5, world_size=4,
                                       peak_tflops=1e-6)
    assert per_device == pytest.approx(step / 4 / 0.5 / 1e12) and mfu == pytest.approx(per_device / 1e-6)
    assert flops.throughput(TINY, real_tokens=8, sum_sq=34, step_time_s=0.5, world_size=4, peak_tflops=None)[1] is None
