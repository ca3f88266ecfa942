"""THD attention core with a sliding window (and a sink) against without, on the same pack, on CPU.

Baseline (measured in the same run): ``thd_attention`` with full causal attention in every sub-sequence. Then
the same pack with ``window_size=(127, 0)`` (gpt-oss's 128-token window), and with the window plus a learnable
sink logit per head. Forward + backward, best of ``--repeats``; one torch thread. The pack is the one
``bench/attention.py`` draws (sub-sequences of 256-768 tokens, 8 query heads, 2 KV heads, head dim 64), plus
``--long``: one pack of a single long sample, where the window's blocks matter most::

    .venv/bin/python bench/attention_window.py [--sizes 4096 8192] [--long 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from attention import make_pack  # bench/attention.py's packs (this file's folder is on the path)

from megatron_pack.model.attention import thd_attention

HEADS, KV_HEADS, DIM, LEFT = 8, 2, 64, 127


def best_seconds(inputs, cu, cu_pad, repeats: int, **kwargs) -> float:
    best = float("inf")
    for i in range(repeats + 1):  # the first run warms up
        for t in inputs:
            t.grad = None
        start = time.perf_counter()
        thd_attention(*inputs, cu, cu_pad, **kwargs).square().sum().backward()
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--long", type=int, nargs="*", default=[8192])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sink = torch.zeros(HEADS).requires_grad_(True)
    print(f"window ({LEFT}, 0); forward + backward, best of {args.repeats}; 1 thread")
    print(f"{'T':>6} {'seqs':>5} {'full s':>8} {'window s':>9} {'ratio':>6} {'win+sink s':>11} {'ratio':>6}")
    packs = [(t, (256, 768)) for t in args.sizes] + [(t, (t, t)) for t in args.long]
    for total, lengths in packs:
        inputs, cu, cu_pad = make_pack(total, lengths=lengths)
        full = best_seconds(inputs, cu, cu_pad, args.repeats)
        window = best_seconds(inputs, cu, cu_pad, args.repeats, window_size=(LEFT, 0))
        both = best_seconds(inputs, cu, cu_pad, args.repeats, window_size=(LEFT, 0), sink=sink)
        print(f"{total:>6} {len(cu) - 1:>5} {full:>8.3f} {window:>9.3f} {full / window:>5.2f}x {both:>11.3f} "
              f"{full / both:>5.2f}x")


if __name__ == "__main__":
    main()
