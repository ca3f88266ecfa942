"""GPU check (not collected by pytest; never run in CI): Transformer Engine THD attention vs our torch core.

On one GPU, at CP = 1, for bfloat16 and float32, runs Transformer Engine's fused
``DotProductAttention`` (``qkv_format="thd"``, ``padding_causal``, with ``cu_seqlens_padded``)
and ``megatron_pack.model.attention.thd_attention`` on the same random pack, and prints one
JSON line per dtype: the largest absolute difference of the outputs (real tokens only; padded
rows are undefined in TE), of the input gradients, and both implementations' tokens/s for
forward and forward+backward::

    python tests/gpu/check_te_thd.py --pack-size 8192 --num-seqs 12 --heads 32 --kv-heads 8 --dim 128
    python tests/gpu/check_te_thd.py --window 127 --softmax-type learnable   # gpt-oss's window and sinks

``--window LEFT`` / ``--softmax-type`` hand both kernels the same sliding window and sink
(``model/attention_reach.py``): TE gets ``window_size=(LEFT, 0)`` and ``softmax_type`` (its
``softmax_offset`` set to ours), our core ``window_size`` and ``sink``.

Needs CUDA and ``transformer_engine`` (``pip install megatron_pack[gpu]``); without them it
prints why and exits 2. This file imports neither at import time, so it can be imported (and
its CPU helpers unit-tested) anywhere. TE may not support float32 THD on a given GPU/version:
that row then reports TE's error instead of numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Optional

import torch

from megatron_pack.model.attention import thd_attention


def make_pack(pack_size: int, num_seqs: int, pad_multiple: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """cu_seqlens / cu_seqlens_padded of a pack of ``num_seqs`` mixed-length sequences filling ``pack_size``.

    Example: ``make_pack(64, 3, 8)`` -> real lengths like [21, 9, 17] padded to [24, 16, 24].
    """
    g = torch.Generator().manual_seed(seed)
    slot = pack_size // num_seqs // pad_multiple * pad_multiple
    if slot < pad_multiple:
        raise ValueError(f"--pack-size {pack_size} is too small for {num_seqs} sequences padded to {pad_multiple}.")
    cu, cu_pad = [0], [0]
    for i in range(num_seqs):
        padded = slot if i < num_seqs - 1 else pack_size - cu_pad[-1]
        real = int(torch.randint(max(1, padded - pad_multiple + 1), padded + 1, (1,), generator=g))
        cu.append(cu[-1] + real)
        cu_pad.append(cu_pad[-1] + padded)
    return cu, cu_pad


def real_rows(cu: list[int], cu_pad: list[int]) -> torch.Tensor:
    """Indices of the real (unpadded) tokens of a pack."""
    return torch.cat([torch.arange(cu_pad[i], cu_pad[i] + cu[i + 1] - cu[i]) for i in range(len(cu) - 1)])


def _timed(fn: Callable[[], torch.Tensor], iters: int, backward: bool) -> float:
    """Seconds per call (CUDA-synchronised), after two warm-up calls."""
    for _ in range(2):
        out = fn()
        if backward:
            out.float().square().sum().backward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        out = fn()
        if backward:
            out.float().square().sum().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def window_and_sink(args) -> tuple[Optional[tuple[int, int]], Optional[torch.Tensor]]:
    """``--window`` as megatron-core's window_size and ``--softmax-type`` as one sink logit per head (None: none).

    Example: ``--window 127 --softmax-type learnable --heads 4`` -> ((127, 0), four fixed logits in [-1, 1]).
    """
    left, softmax_type = getattr(args, "window", -1), getattr(args, "softmax_type", "vanilla")  # callers' old args
    window = (left, 0) if left >= 0 else None
    if softmax_type == "vanilla":
        return window, None
    if softmax_type == "off-by-one":
        return window, torch.zeros(args.heads)
    return window, torch.linspace(-1.0, 1.0, args.heads)


def _te_attention(args, cu_t: torch.Tensor, cu_pad_t: torch.Tensor, max_seqlen: int):
    import transformer_engine.pytorch as te

    window, sink = window_and_sink(args)
    extra = {"window_size": window} if window else {}
    if sink is not None:
        extra["softmax_type"] = getattr(args, "softmax_type")
    module = te.DotProductAttention(num_attention_heads=args.heads, kv_channels=args.dim,
                                    num_gqa_groups=args.kv_heads, attention_dropout=0.0, qkv_format="thd",
                                    attn_mask_type="padding_causal", **extra).cuda()
    if getattr(args, "softmax_type", "vanilla") == "learnable":
        with torch.no_grad():
            module.softmax_offset.copy_(sink.reshape(module.softmax_offset.shape))

    def run(q, k, v):
        out = module(q, k, v, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu_t,
                     cu_seqlens_kv=cu_t, cu_seqlens_q_padded=cu_pad_t, cu_seqlens_kv_padded=cu_pad_t,
                     max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        return out.view(q.size(0), args.heads, args.dim)

    return run


def check_dtype(args, dtype: torch.dtype) -> dict:
    """One row of the report: differences and tokens/s for ``dtype``."""
    cu, cu_pad = make_pack(args.pack_size, args.num_seqs, args.pad_multiple)
    rows = real_rows(cu, cu_pad).cuda()
    cu_t, cu_pad_t = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (cu, cu_pad))
    max_seqlen = max(b - a for a, b in zip(cu_pad, cu_pad[1:]))
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(args.pack_size, args.heads, args.dim)] + [(args.pack_size, args.kv_heads, args.dim)] * 2
    inputs = [torch.randn(s, generator=g, device="cuda", dtype=dtype).requires_grad_(True) for s in shapes]
    window, sink = window_and_sink(args)
    sink = sink.to(device="cuda", dtype=torch.float32) if sink is not None else None
    ours = lambda: thd_attention(*inputs, cu, cu_pad, window_size=window, sink=sink)  # noqa: E731
    row: dict = {"dtype": str(dtype).replace("torch.", ""), "tokens": args.pack_size, "num_seqs": args.num_seqs,
                 "window": getattr(args, "window", -1), "softmax_type": getattr(args, "softmax_type", "vanilla")}
    out_ours = ours()
    grads_ours = torch.autograd.grad(out_ours[rows].float().square().sum(), inputs)
    try:
        te_run = _te_attention(args, cu_t, cu_pad_t, max_seqlen)
        out_te = te_run(*inputs)
        grads_te = torch.autograd.grad(out_te[rows].float().square().sum(), inputs)
    except Exception as exc:  # TE refuses some dtype/GPU/version combinations: report, do not hide
        row["te_error"] = f"{type(exc).__name__}: {exc}"[:500]
        te_run = None
    else:
        row["max_abs_diff_out"] = float((out_te[rows].float() - out_ours[rows].float()).abs().max())
        row["max_abs_diff_grad"] = max(float((a[rows] - b[rows]).float().abs().max())
                                       for a, b in zip(grads_te, grads_ours))
    for name, fn in (("ours", ours), ("te", (lambda: te_run(*inputs)) if te_run else None)):
        if fn is None:
            continue
        for backward in (False, True):
            seconds = _timed(fn, args.iters, backward)
            row[f"{name}_{'fwd_bwd' if backward else 'fwd'}_tokens_per_s"] = round(args.pack_size / seconds)
    if te_run is not None:
        row["speedup_te_over_ours_fwd_bwd"] = round(row["te_fwd_bwd_tokens_per_s"] / row["ours_fwd_bwd_tokens_per_s"], 2)
    return row


def _unavailable() -> Optional[str]:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:
        return f"transformer_engine does not import ({type(exc).__name__}: {exc})"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack-size", type=int, default=8192)
    parser.add_argument("--num-seqs", type=int, default=12)
    parser.add_argument("--pad-multiple", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--window", type=int, default=-1, help="sliding window LEFT (window_size (LEFT, 0)); -1: none")
    parser.add_argument("--softmax-type", default="vanilla", choices=["vanilla", "off-by-one", "learnable"])
    args = parser.parse_args(argv)
    why = _unavailable()
    if why:
        print(f"check_te_thd: {why}; this check needs one GPU with Transformer Engine.", file=sys.stderr)
        return 2
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}))
    for dtype in (torch.bfloat16, torch.float32):
        print(json.dumps(check_dtype(args, dtype)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
