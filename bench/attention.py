"""THD attention core vs the dense baseline: time and largest tensor, forward + backward, on CPU.

Baseline (measured in the same run): ``scaled_dot_product_attention`` over the whole pack with a
block-diagonal causal ``[T, T]`` boolean mask, the usual way to keep packed samples apart without
a varlen kernel. Ours: ``megatron_pack.model.attention.thd_attention``, one sub-sequence at a
time. Each row prints both times, the speed-up (baseline time / ours) and the ratio of the
largest tensor either creates (from an allocation spy run apart from the timing), for packs of
sub-sequences of mixed lengths (mean ~512 tokens), 8 query heads, 2 KV heads, head dim 64::

    .venv/bin/python bench/attention.py [--sizes 2048 4096 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_pack.model.attention import thd_attention

HEADS, KV_HEADS, DIM = 8, 2, 64


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self.numel = max(self.numel, item.numel())
        return out


def make_pack(total: int, seed: int = 0, lengths: tuple[int, int] = (256, 768)):
    """Mixed sub-sequence lengths (``lengths``, inclusive; each padded to 8) filling ``total`` tokens."""
    g = torch.Generator().manual_seed(seed)
    cu, cu_pad = [0], [0]
    while cu_pad[-1] < total:
        real = min(int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g)), total - cu_pad[-1])
        padded = min(-(-real // 8) * 8, total - cu_pad[-1])
        cu.append(cu[-1] + real)
        cu_pad.append(cu_pad[-1] + padded)
    q = torch.randn(total, HEADS, DIM, generator=g)
    k, v = (torch.randn(total, KV_HEADS, DIM, generator=g) for _ in range(2))
    return [t.requires_grad_(True) for t in (q, k, v)], cu, cu_pad


def dense_baseline(q, k, v, cu, cu_pad):
    """SDPA over the whole pack with a block-diagonal causal [T, T] mask (padding masked out)."""
    total = k.size(0)
    seq = torch.zeros(total, dtype=torch.long)
    real = torch.zeros(total, dtype=torch.bool)
    for i in range(len(cu) - 1):
        seq[cu_pad[i]:cu_pad[i + 1]] = i
        real[cu_pad[i]:cu_pad[i] + cu[i + 1] - cu[i]] = True
    idx = torch.arange(total)
    mask = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None]) & real[None, :]
    mask |= ~real[:, None] & (idx[None, :] == idx[:, None])  # padded queries see themselves (no NaN)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1) * real[:, None, None]


def _fwd_bwd(fn, inputs, cu, cu_pad) -> None:
    for t in inputs:
        t.grad = None
    fn(*inputs, cu, cu_pad).square().sum().backward()


def measure(fn, inputs, cu, cu_pad, repeats: int) -> tuple[float, int]:
    """(best seconds of forward + backward, largest tensor in elements)."""
    _fwd_bwd(fn, inputs, cu, cu_pad)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _fwd_bwd(fn, inputs, cu, cu_pad)
        best = min(best, time.perf_counter() - start)
    spy = _Largest()
    with spy:
        _fwd_bwd(fn, inputs, cu, cu_pad)
    return best, spy.numel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"{'T':>6} {'seqs':>5} {'dense s':>9} {'thd s':>8} {'speed-up':>9} "
          f"{'dense max tensor':>17} {'thd max tensor':>15} {'memory ratio':>13} {'max diff':>9}")
    for total in args.sizes:
        inputs, cu, cu_pad = make_pack(total)
        with torch.no_grad():
            diff = float((dense_baseline(*inputs, cu, cu_pad) - thd_attention(*inputs, cu, cu_pad)).abs().max())
        dense_s, dense_n = measure(dense_baseline, inputs, cu, cu_pad, args.repeats)
        thd_s, thd_n = measure(thd_attention, inputs, cu, cu_pad, args.repeats)
        print(f"{total:>6} {len(cu) - 1:>5} {dense_s:>9.3f} {thd_s:>8.3f} {dense_s / thd_s:>8.1f}x "
              f"{dense_n:>17,} {thd_n:>15,} {dense_n / thd_n:>12.1f}x {diff:>9.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
