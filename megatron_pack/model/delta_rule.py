"""The gated delta rule and its causal conv1d over a THD pack: state restarts at every sub-sequence.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) carries two things along the sequence: a depthwise causal
conv1d window (the last ``K - 1`` inputs) and a recurrent state ``S`` [key_dim, value_dim] per head::

    S_t = exp(g_t) * S_{t-1} + beta_t * k_t (v_t - exp(g_t) * S_{t-1}^T k_t)^T      o_t = S_t^T q_t * scale

What a token at position p of sub-sequence s may read (STYLE 24): the real tokens 0..p of s, nothing
else. Both carriers therefore restart at every ``cu_seqlens`` start: the conv1d sees zeros left of a
sub-sequence's first token, and ``S`` is zero before it. Padding rows (the tail of each slot of
``cu_seqlens_padded``) neither feed nor receive state: they are zeros on the way in and out.

Two kernels behind one contract (``packed_gated_delta_rule``):

* ``torch`` (CPU, and a GPU without fla): transformers' chunked algorithm (WY / UT transform per chunk
  of 64 tokens, then a scan over chunks), with every sub-sequence's chunks starting at its own first
  token. It runs once per chunk *index* j, over chunk j of every sub-sequence that has one (sorted
  longest first, so the live ones are a prefix and the state just shrinks): ``ceil(longest / 64)``
  steps, not one loop per sub-sequence; padding rows are never gathered.
* ``fla`` (bfloat16/float16 CUDA tensors with flash-linear-attention installed):
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with ``cu_seqlens``. Its varlen boundaries are the *padded* ones: a slot's padding comes after its
  real tokens, so causally it cannot reach them, and the state restarts at the next slot; padded rows
  are zeroed on the way in and out. Not run in CI (no GPU there): a thin call with the same interface.

Worked example, ``cu_seqlens=[0, 3, 5]``, ``cu_seqlens_padded=[0, 4, 8]``, ``K=4``: row 4 (the first
token of sub-sequence 1) reads conv taps at rows 1-3 as zeros and starts from ``S = 0``; rows 3, 6, 7
are padding and come out as zeros.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_pack.parallel.cp import thd_local_segments

try:  # the optional GPU extra, imported guarded like Transformer Engine
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule
except ImportError:  # pragma: no cover - depends on the host
    _fla_chunk_gated_delta_rule = None

KERNELS = ("auto", "torch", "fla")
"""``auto``: fla for bfloat16/float16 CUDA tensors when it imports, else torch (``choose_kernel``)."""
CHUNK_SIZE = 64


def _as_list(values) -> list[int]:
    return values.tolist() if isinstance(values, Tensor) else [int(v) for v in values]


def _cu_pair(cu_seqlens, cu_seqlens_padded, total: int) -> tuple[Tensor, Tensor]:
    cu = torch.as_tensor(_as_list(cu_seqlens), dtype=torch.int64)
    cu_pad = cu if cu_seqlens_padded is None else torch.as_tensor(_as_list(cu_seqlens_padded), dtype=torch.int64)
    if cu.numel() != cu_pad.numel() or int(cu_pad[-1]) != total:
        raise ValueError(f"cu_seqlens ({cu.numel()} entries) and cu_seqlens_padded ({cu_pad.numel()} entries, "
                         f"last {int(cu_pad[-1])}) must list the same sub-sequences and end at the pack's "
                         f"{total} rows.")
    real, padded = cu[1:] - cu[:-1], cu_pad[1:] - cu_pad[:-1]
    if bool(((real < 0) | (real > padded)).any()):
        raise ValueError(f"every real length (cu_seqlens {cu.tolist()[:16]}) must lie in [0, its padded length] "
                         f"(cu_seqlens_padded {cu_pad.tolist()[:16]}).")
    return cu, cu_pad


def pack_positions(cu_seqlens, cu_seqlens_padded, total: int, device=None) -> tuple[Tensor, Tensor]:
    """(in-sequence position [T], real-token mask [T]) of every row of a pack in global order.

    Example: ``cu_seqlens=[0, 3, 5]``, ``cu_seqlens_padded=[0, 4, 8]`` -> positions
    ``[0, 1, 2, 3, 0, 1, 2, 3]``, real ``[T, T, T, F, T, T, F, F]``.
    """
    cu, cu_pad = _cu_pair(cu_seqlens, cu_seqlens_padded, total)
    seq, real = thd_local_segments(cu, cu_pad, total, 1, 0)
    position = torch.arange(total) - cu_pad[seq]
    return position.to(device), real.to(device)


def packed_causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], cu_seqlens, cu_seqlens_padded=None,
                         activation=F.silu) -> Tensor:
    """Depthwise causal conv1d of ``x`` [T, C] (global pack order) with ``weight`` [C, K] per sub-sequence.

    Each sub-sequence is convolved as if alone (zeros left of its first token); padding rows are zero
    on input and output. Returns ``activation(conv)`` [T, C]. K shifted multiply-adds over the whole
    pack, no loop over sub-sequences.
    """
    total, width = x.size(0), weight.size(-1)
    position, real = pack_positions(cu_seqlens, cu_seqlens_padded, total, x.device)
    x = x * real[:, None].to(x.dtype)
    out = x * weight[:, width - 1]
    for shift in range(1, width):  # tap ``shift`` reads row t - shift, only inside the same sub-sequence
        if shift >= total:
            break
        shifted = F.pad(x[:total - shift], (0, 0, shift, 0))
        out = out + shifted * weight[:, width - 1 - shift] * (position >= shift)[:, None].to(x.dtype)
    if bias is not None:
        out = out + bias
    if activation is not None:
        out = activation(out)
    return out * real[:, None].to(out.dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and transformers' definition)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _chunk_layout(cu: Tensor, cu_pad: Tensor, chunk_size: int, total: int):
    """Rows of every chunk, step-major: all sub-sequences' chunk 0 (longest first), then chunk 1, ...

    Returns (rows [num_chunks, chunk_size], valid [num_chunks, chunk_size], step slices [(lo, hi)],
    number of sub-sequences with a real token). A slot past its sub-sequence's end reads row ``total``
    (a zero row). Example, real lengths [3, 130], chunk 64: sub-sequence 1 first, steps
    ``[(0, 2), (2, 3), (3, 4)]`` (2 live at step 0, 1 at steps 1 and 2).
    """
    lengths, starts = cu[1:] - cu[:-1], cu_pad[:-1]
    keep = lengths > 0
    lengths, starts = lengths[keep], starts[keep]
    order = torch.argsort(lengths, descending=True, stable=True)
    lengths, starts = lengths[order], starts[order]
    num_chunks = (lengths + chunk_size - 1) // chunk_size
    max_chunks = int(num_chunks.max()) if num_chunks.numel() else 0
    live = num_chunks[None, :] > torch.arange(max_chunks)[:, None]  # [step, sequence]
    step, seq = torch.nonzero(live, as_tuple=True)  # row-major: step-major, longest first inside a step
    position = step[:, None] * chunk_size + torch.arange(chunk_size)[None, :]
    valid = position < lengths[seq][:, None]
    rows = torch.where(valid, starts[seq][:, None] + position, torch.full_like(position, total))
    per_step = live.sum(1).tolist()
    bounds = [0]
    for n in per_step:
        bounds.append(bounds[-1] + n)
    return rows, valid, list(zip(bounds[:-1], bounds[1:])), int(keep.sum())


def _gather_chunks(x: Tensor, rows: Tensor) -> Tensor:
    """x [T, H, ...] -> [num_chunks, H, chunk, ...] with zeros at slots past a sub-sequence's end."""
    padded = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])
    out = padded.index_select(0, rows.reshape(-1)).reshape(rows.shape + tuple(x.shape[1:]))
    return out.transpose(1, 2).contiguous()


def _intra_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, upper: Tensor):
    """Per chunk [n, H, L, .]: what the scan needs (transformers' first phase, with the UT transform).

    Returns (new values, decayed keys reading the old state, decayed queries, intra-chunk attention,
    keys decayed to the chunk's end, the chunk's total decay [n, H, 1, 1])."""
    q = q * scale
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # the UT transform: (I + strictly_lower(beta K K^T * decay))^-1 condenses the chunk's delta updates
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pairwise
    return (new_values, k_cumdecay, q * cum.exp()[..., None], intra, k * (cum[..., -1:] - cum).exp()[..., None],
            cum[..., -1].exp()[..., None, None])


def torch_packed_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens,
                                  cu_seqlens_padded=None, *, scale: Optional[float] = None,
                                  chunk_size: int = CHUNK_SIZE) -> Tensor:
    """The chunked gated delta rule over a pack, state zero at every sub-sequence start.

    Computes in float32 (float64 for float64 inputs).

    q, k [T, H, dk]; v [T, H, dv]; g (log decay, <= 0), beta [T, H]; heads already expanded (GQA).
    Returns [T, H, dv] in ``v``'s dtype; padding rows are zeros.
    """
    total, dtype = q.size(0), v.dtype
    work = torch.promote_types(dtype, torch.float32)  # float32, or float64 for a float64 reference
    cu, cu_pad = _cu_pair(cu_seqlens, cu_seqlens_padded, total)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    rows, valid, steps, num_live = _chunk_layout(cu, cu_pad, chunk_size, total)
    out = v.new_zeros(v.shape, dtype=work)
    if not steps:  # no real token: keep the graph connected, every input's gradient exactly 0
        return (out + (q[:0].sum() + k[:0].sum() + v[:0].sum() + g[:0].sum() + beta[:0].sum())).to(dtype)
    rows = rows.to(q.device)
    q, k, v = (_gather_chunks(t.to(work), rows) for t in (q, k, v))  # [C, H, L, d]
    g, beta = (_gather_chunks(t.to(work), rows) for t in (g, beta))  # [C, H, L]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    state = q.new_zeros(num_live, q.size(1), q.size(-1), v.size(-1))  # zero at every sub-sequence start
    sizes = [hi - lo for lo, hi in steps]
    # step j holds chunk j of every sub-sequence that has one, longest first: a block small enough to stay
    # in cache (one intra-chunk pass over the whole pack ran ~1.3x slower on CPU); split once per tensor
    # (one cat in backward), not sliced per step (a zero-filled full-size gradient per slice)
    outputs = []
    for n, block in zip(sizes, zip(*(t.split(sizes) for t in (q, k, v, g, beta)))):
        if n < state.size(0):  # the shorter sub-sequences have ended: the live ones are a prefix
            state = state.split([n, state.size(0) - n])[0]
        values, k_cum, q_dec, attn, k_dec, decay = _intra_chunk(*block, scale, upper)
        v_new = values - k_cum @ state
        outputs.append(q_dec @ state + attn @ v_new)
        state = state * decay + k_dec.transpose(-1, -2) @ v_new
    chunked = torch.cat(outputs).transpose(1, 2).reshape(-1, out.size(1), out.size(2))  # [C*L, H, dv]
    keep = valid.reshape(-1).to(q.device)
    return out.index_copy(0, rows.reshape(-1)[keep], chunked[keep]).to(dtype)


def fla_packed_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens,
                                cu_seqlens_padded=None, *, scale: Optional[float] = None,
                                chunk_size: int = CHUNK_SIZE) -> Tensor:
    """fla's varlen kernel with the padded boundaries (see the module docstring); same contract as torch's.

    Not exercised in CI (CUDA only). Zero-length slots (a fixed-length cu_seqlens tail) are dropped
    from the boundaries, which fla's chunk indexing does not expect.
    """
    if _fla_chunk_gated_delta_rule is None:
        raise RuntimeError("the fla kernel needs flash-linear-attention (pip install flash-linear-attention) and CUDA.")
    total = q.size(0)
    position, real = pack_positions(cu_seqlens, cu_seqlens_padded, total, q.device)
    bounds = torch.unique_consecutive(torch.as_tensor(_as_list(
        cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens), dtype=torch.int64)).to(q.device)
    mask = real[:, None].to(q.dtype)
    q, k, v = (t * mask[..., None] for t in (q, k, v))
    g, beta = g * mask, beta * mask
    out, _ = _fla_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                                         cu_seqlens=bounds, use_qk_l2norm_in_kernel=False)
    return out[0] * mask[..., None]


def choose_kernel(requested: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """``auto`` -> 'fla' for bfloat16/float16 CUDA tensors when fla imports (its chunked kernel refuses
    float32), else 'torch'; 'fla' elsewhere is refused."""
    if requested not in KERNELS:
        raise ValueError(f"linear-attention kernel {requested!r} must be one of {list(KERNELS)}.")
    fla_ok = (_fla_chunk_gated_delta_rule is not None and device.type == "cuda"
              and dtype in (torch.bfloat16, torch.float16))
    if requested == "fla" and not fla_ok:
        raise ValueError("the fla linear-attention kernel needs bfloat16/float16 CUDA tensors and "
                         "flash-linear-attention installed; use kernel='torch' (or 'auto').")
    return "fla" if requested == "fla" or (requested == "auto" and fla_ok) else "torch"


def packed_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens,
                            cu_seqlens_padded=None, *, scale: Optional[float] = None, kernel: str = "auto",
                            use_qk_l2norm: bool = False) -> Tensor:
    """The gated delta rule over a THD pack, one contract for every kernel (the module docstring).

    q, k [T, Hk, dk]; v [T, Hv, dv] with Hv a multiple of Hk (each q/k head serves ``Hv/Hk`` consecutive
    value heads); g, beta [T, Hv]; rows in global pack order. ``use_qk_l2norm`` normalises q and k
    (in float32) first. Returns [T, Hv, dv]; padding rows are zeros.
    """
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.size(1) % k.size(1) or g.shape != v.shape[:2] \
            or beta.shape != g.shape:
        raise ValueError(f"packed_gated_delta_rule expects q, k [T, Hk, dk], v [T, Hv, dv] (Hv a multiple of Hk), "
                         f"g, beta [T, Hv]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(g.shape)}, {tuple(beta.shape)}.")
    if use_qk_l2norm:
        work = torch.promote_types(q.dtype, torch.float32)
        q, k = l2norm(q.to(work)).to(q.dtype), l2norm(k.to(work)).to(k.dtype)
    if v.size(1) != k.size(1):
        q, k = (t.repeat_interleave(v.size(1) // k.size(1), dim=1) for t in (q, k))
    chosen = choose_kernel(kernel, q.device, v.dtype)
    run = fla_packed_gated_delta_rule if chosen == "fla" else torch_packed_gated_delta_rule
    return run(q, k, v, g, beta, cu_seqlens, cu_seqlens_padded, scale=scale)
