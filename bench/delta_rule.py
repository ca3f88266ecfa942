"""Packed gated delta rule (CPU torch kernel) vs a per-sample loop of the same math: forward + backward.

Baseline (measured in the same run): transformers' ``torch_chunk_gated_delta_rule`` (Qwen3.5's CPU path,
the same chunked algorithm with 64-token chunks) called once per sub-sequence, the way a packed batch
is run without a varlen kernel. Ours: ``megatron_pack.model.delta_rule.packed_gated_delta_rule``
(kernel='torch'): the intra-chunk work of every chunk of the pack at once, then one scan step per chunk
index over every sub-sequence that has that chunk. Each row prints both times, the speed-up (baseline
/ ours), the number of sequential scan steps each takes, and the largest output difference::

    .venv/bin/python bench/delta_rule.py [--sizes 2048 4096 8192] [--mix short|mixed] [--repeats 5] [--heads 4 8 64]

Heads: 4 query/key heads, 8 value heads, head dim 64 by default (Qwen3.5's shapes are 16/32/128; fewer here so the
CPU run stays short; ``--heads 8 16 128`` runs a TP=2 rank's half of Qwen3.5's layer); float32, one torch thread.
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_pack.model.delta_rule import CHUNK_SIZE, packed_gated_delta_rule

KEY_HEADS, VALUE_HEADS, DIM = 4, 8, 64
MIXES = {"short": (32, 256), "mixed": (64, 1024)}
"""Real sub-sequence lengths drawn uniformly from this range (padded to 8)."""


def make_pack(total: int, low: int, high: int, seed: int = 0, heads: tuple = (KEY_HEADS, VALUE_HEADS, DIM)):
    key_heads, value_heads, dim = heads
    g = torch.Generator().manual_seed(seed)
    cu, cu_pad = [0], [0]
    while cu_pad[-1] < total:
        real = min(int(torch.randint(low, high + 1, (1,), generator=g)), total - cu_pad[-1])
        padded = min(-(-real // 8) * 8, total - cu_pad[-1])
        cu.append(cu[-1] + real)
        cu_pad.append(cu_pad[-1] + padded)
    q, k = (torch.nn.functional.normalize(torch.randn(total, key_heads, dim, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(total, value_heads, dim, generator=g)
    decay = -torch.rand(total, value_heads, generator=g) * 0.1
    beta = torch.rand(total, value_heads, generator=g)
    return [t.requires_grad_(True) for t in (q, k, v, decay, beta)], cu, cu_pad


def ours(q, k, v, decay, beta, cu, cu_pad):
    return packed_gated_delta_rule(q, k, v, decay, beta, cu, cu_pad, kernel="torch")


def per_sample_loop(q, k, v, decay, beta, cu, cu_pad):
    """transformers' chunked delta rule on each sub-sequence alone; padding rows stay zero."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    out = v.new_zeros(v.shape)
    pieces, rows = [], []
    for i in range(len(cu) - 1):
        start, n = cu_pad[i], cu[i + 1] - cu[i]
        if n == 0:
            continue
        alone, _ = torch_chunk_gated_delta_rule(*(t[None, start:start + n] for t in (q, k, v, decay, beta)))
        pieces.append(alone[0])
        rows.append(torch.arange(start, start + n))
    return out.index_copy(0, torch.cat(rows), torch.cat(pieces))


def _fwd_bwd(fn, inputs, cu, cu_pad) -> None:
    for t in inputs:
        t.grad = None
    fn(*inputs, cu, cu_pad).square().sum().backward()


def measure(fns, inputs, cu, cu_pad, repeats: int) -> list[float]:
    """Best seconds of forward + backward of each of ``fns`` after one warm-up, the runs interleaved
    (so a change of load on a shared machine hits every variant alike)."""
    for fn in fns:
        _fwd_bwd(fn, inputs, cu, cu_pad)
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            _fwd_bwd(fn, inputs, cu, cu_pad)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--mix", choices=sorted(MIXES), default="mixed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", type=int, nargs=3, default=[KEY_HEADS, VALUE_HEADS, DIM],
                        metavar=("KEY", "VALUE", "DIM"), help="query/key heads, value heads, head dim "
                        "(Qwen3.5's layer: 16 32 128; a TP=2 rank's half of it: 8 16 128)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'T':>6} {'seqs':>5} {'loop s':>8} {'packed s':>9} {'speed-up':>9} {'loop steps':>11} "
          f"{'packed steps':>13} {'max diff':>9}")
    for total in args.sizes:
        inputs, cu, cu_pad = make_pack(total, *MIXES[args.mix], heads=tuple(args.heads))
        lengths = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        chunks = [-(-n // CHUNK_SIZE) for n in lengths]
        with torch.no_grad():
            diff = float((per_sample_loop(*inputs, cu, cu_pad) - ours(*inputs, cu, cu_pad)).abs().max())
        loop_s, ours_s = measure([per_sample_loop, ours], inputs, cu, cu_pad, args.repeats)
        print(f"{total:>6} {len(lengths):>5} {loop_s:>8.3f} {ours_s:>9.3f} {loop_s / ours_s:>8.1f}x "
              f"{sum(chunks):>11} {max(chunks):>13} {diff:>9.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
