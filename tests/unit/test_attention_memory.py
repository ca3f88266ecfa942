"""The THD attention never creates a [T, T] tensor: an allocation spy over every aten op.

A ``TorchDispatchMode`` records the element count of every tensor any op returns (forward and
backward). For a pack of T = 32768 tokens in 64 sub-sequences the largest tensor must stay far
below T*T elements, on the CP=1 path (SDPA's causal kernel) and on the CP path (zigzag queries,
explicit per-sequence masks); the same spy run on a dense reference at a small T proves that it
does catch a [T, T] score matrix.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_pack.model.attention import thd_attention


class _LargestAllocation(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest, self.num_ops = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.num_ops += 1
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self.largest = max(self.largest, item.numel())
        return out


def _pack(total: int, num_seqs: int, heads: int = 2, kv_heads: int = 1, dim: int = 8):
    slot = total // num_seqs
    cu_pad = [i * slot for i in range(num_seqs + 1)]
    real = [slot - (i % 5) for i in range(num_seqs)]  # mixed real lengths inside fixed slots
    cu = [0]
    for n in real:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, heads, dim, generator=g, requires_grad=True)
    k = torch.randn(total, kv_heads, dim, generator=g, requires_grad=True)
    v = torch.randn(total, kv_heads, dim, generator=g, requires_grad=True)
    return q, k, v, cu, cu_pad


def _dense_attention(q, k, v):
    """Plain causal attention over the whole pack with an explicit [T, T] score matrix."""
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.size(-1) ** 0.5
    causal = torch.ones(q.size(0), k.size(0), dtype=torch.bool).tril()
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("kind,total,num_seqs", [
    ("thd", 32768, 256),
    ("thd_cp2_rank0", 32768, 256),
    ("dense_reference", 1024, 8),
], ids=["thd_T32768_no_TxT", "thd_cp2_zigzag_T32768_no_TxT", "dense_T1024_spy_sees_TxT"])
def test_largest_tensor_forward_and_backward(kind, total, num_seqs):
    from megatron_pack.parallel.cp import thd_partition_indices

    q, k, v, cu, cu_pad = _pack(total, num_seqs)
    spy = _LargestAllocation()
    with spy:
        if kind == "dense_reference":
            out = _dense_attention(q, k, v)
        elif kind == "thd_cp2_rank0":  # the CP path: zigzag queries (explicit masks) over all keys
            rows = thd_partition_indices(torch.tensor(cu_pad), 2, 0)
            out = thd_attention(q[rows], k, v, cu, cu_pad, query_index=rows)
        else:
            out = thd_attention(q, k, v, cu, cu_pad)
        out.square().sum().backward()
    assert spy.num_ops > 50 and q.grad is not None and float(k.grad.abs().sum()) > 0
    if kind == "dense_reference":
        assert spy.largest >= total * total  # the spy does see a [T, T] tensor when one is made
    else:
        slot = total // num_seqs
        # the largest tensor is a per-sequence score/mask block or an activation, never T*T
        assert spy.largest <= max(q.numel(), q.size(1) * slot * slot)
        assert spy.largest < total * total // 100
