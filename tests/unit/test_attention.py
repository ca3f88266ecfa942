"""The pure-torch THD attention (``thd_attention``): hand-built cases, CP emulation, properties.

The reference is dense attention with an explicit block-diagonal causal mask over the pack,
fine for the tiny packs here (the real kernel never builds such a mask; see
test_attention_memory.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.model.attention import thd_attention
from megatron_pack.parallel.cp import thd_partition_indices

torch.use_deterministic_algorithms(True)


def _dense_reference(q, k, v, cu, cu_pad, scale=None):
    """Block-diagonal causal attention with an explicit [T, T] mask; padded rows -> 0."""
    total = k.size(0)
    seg = torch.full((total,), -1)
    real = torch.zeros(total, dtype=torch.bool)
    pos = torch.zeros(total, dtype=torch.long)
    for i in range(len(cu) - 1):
        seg[cu_pad[i]:cu_pad[i + 1]] = i
        pos[cu_pad[i]:cu_pad[i + 1]] = torch.arange(cu_pad[i + 1] - cu_pad[i])
        real[cu_pad[i]:cu_pad[i] + cu[i + 1] - cu[i]] = True
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None]) & real[None, :] & real[:, None]
    rep = q.size(1) // k.size(1)
    k_, v_ = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    scores = torch.einsum("qhd,khd->hqk", q, k_) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v_) * real[:, None, None]


def _qkv(total, heads=4, kv_heads=2, dim=8, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


CASES = [
    # (cu_seqlens, cu_seqlens_padded, heads, kv_heads)
    ([0, 8], [0, 8], 4, 4),                         # one sequence, no padding, MHA
    ([0, 3, 5], [0, 4, 8], 4, 2),                   # the module docstring's example, GQA 2
    ([0, 5, 12, 13], [0, 5, 12, 13], 4, 1),         # 3 sequences unpadded, MQA
    ([0, 5, 12, 13, 13], [0, 8, 16, 20, 32], 2, 2),  # padded, plus a zero-length tail sequence
    ([0, 1, 2, 3], [0, 4, 8, 12], 6, 3),            # single-token sequences in padded slots
]
IDS = ["one_seq_mha", "docstring_gqa2", "three_seq_mqa", "padded_with_tail", "single_tokens"]


@pytest.mark.parametrize("cu,cu_pad,heads,kv_heads", CASES, ids=IDS)
def test_matches_dense_block_diagonal_reference(cu, cu_pad, heads, kv_heads):
    q, k, v = _qkv(cu_pad[-1], heads, kv_heads)
    out = thd_attention(q, k, v, cu, cu_pad)
    ref = _dense_reference(q, k, v, cu, cu_pad)
    assert out.shape == q.shape
    assert float(ref.abs().max()) > 0.1  # the check compares something non-trivial
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cu,cu_pad,heads,kv_heads", CASES, ids=IDS)
def test_gradients_match_dense_reference(cu, cu_pad, heads, kv_heads):
    q, k, v = _qkv(cu_pad[-1], heads, kv_heads, requires_grad=True)
    grad_out = torch.randn(cu_pad[-1], heads, q.size(-1), generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((thd_attention(q, k, v, cu, cu_pad) * grad_out).sum(), (q, k, v))
    ref = torch.autograd.grad((_dense_reference(q, k, v, cu, cu_pad) * grad_out).sum(), (q, k, v))
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float(grads[2].abs().sum()) > 0  # value grads exist even for single-token sequences


def test_padded_rows_are_zero_and_padded_keys_ignored():
    cu, cu_pad = [0, 3, 5], [0, 4, 8]
    q, k, v = _qkv(8)
    out = thd_attention(q, k, v, cu, cu_pad)
    assert out[[3, 6, 7]].abs().max() == 0
    k2, v2 = k.clone(), v.clone()
    k2[[3, 6, 7]] += 100.0
    v2[[3, 6, 7]] -= 100.0
    torch.testing.assert_close(thd_attention(q, k2, v2, cu, cu_pad), out, atol=0, rtol=0)


def test_softmax_scale_is_used():
    cu = [0, 6]
    q, k, v = _qkv(6)
    out = thd_attention(q, k, v, cu, cu, softmax_scale=0.05)
    torch.testing.assert_close(out, _dense_reference(q, k, v, cu, cu, scale=0.05), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(out, thd_attention(q, k, v, cu, cu), atol=1e-4)


def test_pack_causal_mode_leaks_across_sequences():
    cu, cu_pad = [0, 4, 8], [0, 4, 8]
    q, k, v = _qkv(8)
    good = thd_attention(q, k, v, cu, cu_pad)
    broken = thd_attention(q, k, v, cu, cu_pad, mode="pack_causal")
    torch.testing.assert_close(broken, _dense_reference(q, k, v, [0, 8], [0, 8]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(broken[:4], good[:4], atol=1e-6, rtol=1e-5)  # first sequence sees nothing new
    assert float((broken[4:] - good[4:]).abs().max()) > 1e-3  # the second one attends into the first


CP_CASES = [([0, 8, 16], [0, 8, 16], 2), ([0, 3, 11], [0, 4, 12], 2), ([0, 5, 6, 14], [0, 8, 16, 24], 4),
            ([0, 7, 7], [0, 8, 16], 2)]


@pytest.mark.parametrize("cu,cu_pad,cp", CP_CASES, ids=["two_full_cp2", "padded_cp2", "three_cp4", "empty_tail_cp2"])
def test_cp_query_rows_match_full_pack(cu, cu_pad, cp):
    """Each CP rank's zigzag queries over the full K/V give exactly the full pack's rows."""
    q, k, v = _qkv(cu_pad[-1])
    full = thd_attention(q, k, v, cu, cu_pad)
    num_nonzero = 0
    for rank in range(cp):
        rows = thd_partition_indices(torch.tensor(cu_pad), cp, rank)
        local = thd_attention(q[rows], k, v, cu, cu_pad, query_index=rows)
        torch.testing.assert_close(local, full[rows], atol=1e-6, rtol=1e-5)
        num_nonzero += int((local.abs().sum(dim=(1, 2)) > 0).sum())
    assert num_nonzero == cu[-1]  # every real token was checked, every padded one is zero


PADDING_ONLY_CASES = [  # (cu, cu_pad, cp, rank whose query rows are all padding)
    ([0, 1, 2, 3, 4, 4], [0, 4, 8, 12, 16, 20], 2, 1),  # four 1-token sequences + tail: the repro
    ([0, 1, 2, 2], [0, 8, 16, 24], 4, 3),
    ([0, 1, 2, 2], [0, 8, 16, 24], 4, 1),
]


@pytest.mark.parametrize("cu,cu_pad,cp,rank", PADDING_ONLY_CASES, ids=["cp2-rank1", "cp4-rank3", "cp4-rank1"])
def test_padding_only_rank_output_depends_on_key_and_value(cu, cu_pad, cp, rank):
    """A rank without a real query row returns zeros that still reach K and V in backward (so
    its backward enters the K/V reduce-scatter under CP), with zero gradients, never NaN."""
    q, k, v = _qkv(cu_pad[-1], requires_grad=True)
    rows = thd_partition_indices(torch.tensor(cu_pad), cp, rank)
    local_q = q[rows]
    with torch.no_grad():
        k[0, 0, 0] = float("inf")  # a non-finite key must not turn the zero gradient into NaN
    out = thd_attention(local_q, k, v, cu, cu_pad, query_index=rows)
    assert out.shape == local_q.shape and bool((out == 0).all())
    grads = torch.autograd.grad(out.sum(), [q, k, v])  # raises if k or v is not in the graph
    for grad in grads:
        assert grad.shape[0] == cu_pad[-1] and bool((grad == 0).all())


def test_bad_inputs_name_the_problem():
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match="padded total"):
        thd_attention(q, k, v, [0, 4], [0, 6])
    with pytest.raises(ValueError, match="real length 5"):
        thd_attention(q, k, v, [0, 5, 6], [0, 4, 8])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        thd_attention(q, k[:, :1].expand(8, 3, 8), v[:, :1].expand(8, 3, 8), [0, 8], [0, 8])
    with pytest.raises(ValueError, match="mode"):
        thd_attention(q, k, v, [0, 8], [0, 8], mode="bidirectional")


def test_thd_attention_module_does_not_import_megatron_at_import_time():
    """thd_attention stays usable without megatron-core: no module-level megatron import."""
    import ast
    import inspect

    import megatron_pack.model.attention as attention

    tree = ast.parse(inspect.getsource(attention))
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [alias.name for node in top_level for alias in node.names] + [
        node.module for node in top_level if isinstance(node, ast.ImportFrom) and node.module]
    assert len(top_level) >= 5 and not [n for n in names if n.split(".")[0] == "megatron"]


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5), extra=st.lists(st.integers(0, 3), min_size=5,
                                                                                     max_size=5))
def test_every_sequence_equals_itself_alone(lengths, extra):
    """Property: a sub-sequence's output in the pack equals its output as a pack of one."""
    cu, cu_pad = [0], [0]
    for n, pad in zip(lengths, extra):
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + n + pad)
    if cu_pad[-1] == 0:
        return
    q, k, v = _qkv(cu_pad[-1], seed=len(lengths))
    out = thd_attention(q, k, v, cu, cu_pad)
    for i, n in enumerate(lengths):
        s = slice(cu_pad[i], cu_pad[i + 1])
        alone = thd_attention(q[s], k[s], v[s], [0, n], [0, cu_pad[i + 1] - cu_pad[i]])
        torch.testing.assert_close(out[s], alone, atol=1e-6, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 3), min_size=1, max_size=4), cp=st.sampled_from([2, 4]),
       fill=st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4))
def test_cp_ranks_reproduce_the_full_pack(lengths, cp, fill):
    """Property: with any padded lengths (multiples of 2*CP), every rank's zigzag rows equal the full rows."""
    cu, cu_pad = [0], [0]
    for chunks, share in zip(lengths, fill):
        padded = chunks * 2 * cp
        cu.append(cu[-1] + int(round(share * padded)))
        cu_pad.append(cu_pad[-1] + padded)
    q, k, v = _qkv(cu_pad[-1], seed=cp)
    full = thd_attention(q, k, v, cu, cu_pad)
    covered = 0
    for rank in range(cp):
        rows = thd_partition_indices(torch.tensor(cu_pad), cp, rank)
        torch.testing.assert_close(thd_attention(q[rows], k, v, cu, cu_pad, query_index=rows), full[rows],
                                   atol=1e-6, rtol=1e-5)
        covered += rows.numel()
    assert covered == cu_pad[-1]
