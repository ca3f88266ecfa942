"""A float64 plain-torch forward of the tiny GPT (RMSNorm, RoPE, GQA, SwiGLU or top-k MoE, untied output).

It shares no code with megatron-core or megatron_pack: it reads a ``{name: tensor}`` dict in
megatron-core's parameter names (TP=1) and runs each sample alone, with its own positions
0..n-2, so it is the reference for packed / parallel results. Layouts it relies on:

* ``linear_qkv.weight`` [(heads + 2*groups) * d, H]: per query group, its ``heads/groups`` query
  heads, then one key head, then one value head (megatron-core's interleaved QKV);
* ``linear_fc1.weight`` [2F, H]: ``[gate; up]``, output ``silu(gate) * up``;
* a MoE layer (``mlp.router.weight`` [E, H] present): each token goes to the ``topk`` experts of the largest
  router logits, weighted by the softmax over those k logits (megatron-core's ``moe_router_pre_softmax=False``,
  HF's ``norm_topk_prob``); expert ``e`` is ``mlp.experts.local_experts.<e>.linear_fc1/2.weight``, a SwiGLU
  MLP as above (``e`` the global expert index);
* RoPE on the whole head dim, not interleaved: ``x * cos + rotate_half(x) * sin`` with
  ``rotate_half([a, b]) = [-b, a]`` and ``angle = position * base**(-2i/d)``.

Example::

    params = {n: p.detach() for n, p in model.named_parameters()}
    loss_sum, count = sample_loss(to_float64(params), ids, answer_mask, TINY)   # one sample
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    num_layers: int = 2
    num_heads: int = 4
    num_groups: int = 2
    head_dim: int = 16
    rotary_base: float = 10000.0
    eps: float = 1e-5
    topk: int = 2


TINY = Shape()
"""The default ``ModelConfig`` (megatron_pack.config.schema)."""


def to_float64(params: dict) -> dict[str, torch.Tensor]:
    """Leaf float64 copies that require grad (so ``.grad`` holds the reference gradient)."""
    return {n: torch.as_tensor(p).detach().to(torch.float64).clone().requires_grad_(True) for n, p in params.items()}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, shape: Shape) -> torch.Tensor:
    """x [n, heads, d], rotated by positions 0..n-1."""
    d = x.size(-1)
    inv_freq = shape.rotary_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(x.size(0), dtype=torch.float64)[:, None] * inv_freq[None, :]
    angle = torch.cat([angle, angle], dim=-1)[:, None, :]
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * angle.cos() + rotated * angle.sin()


def _attention(h: torch.Tensor, p: dict, prefix: str, shape: Shape) -> torch.Tensor:
    n, d = h.size(0), shape.head_dim
    per_group = shape.num_heads // shape.num_groups
    qkv = (h @ p[prefix + "linear_qkv.weight"].T).view(n, shape.num_groups, per_group + 2, d)
    q = qkv[:, :, :per_group].reshape(n, shape.num_heads, d)
    k = qkv[:, :, per_group].repeat_interleave(per_group, dim=1)
    v = qkv[:, :, per_group + 1].repeat_interleave(per_group, dim=1)
    q, k = _rope(q, shape), _rope(k, shape)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, shape.num_heads * d)
    return out @ p[prefix + "linear_proj.weight"].T


def _swiglu(x: torch.Tensor, p: dict, prefix: str) -> torch.Tensor:
    gate, up = (x @ p[prefix + "linear_fc1.weight"].T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ p[prefix + "linear_fc2.weight"].T


def _mlp(x: torch.Tensor, p: dict, prefix: str, shape: Shape) -> torch.Tensor:
    """The dense SwiGLU, or the top-k mixture of SwiGLU experts when the layer has a router."""
    if prefix + "mlp.router.weight" not in p:
        return _swiglu(x, p, prefix + "mlp.")
    top, experts = (x @ p[prefix + "mlp.router.weight"].T).topk(shape.topk, dim=-1)
    weights = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x)
    for k in range(shape.topk):
        for e in experts[:, k].unique().tolist():
            rows = (experts[:, k] == e).nonzero().flatten()
            routed = _swiglu(x[rows], p, f"{prefix}mlp.experts.local_experts.{e}.")
            out = out.index_add(0, rows, weights[rows, k:k + 1] * routed)
    return out


def logits(p: dict, tokens: list[int], shape: Shape = TINY) -> torch.Tensor:
    """[n, V] float64 logits of one sequence run alone."""
    h = p["embedding.word_embeddings.weight"][torch.as_tensor(tokens)]
    for layer in range(shape.num_layers):
        prefix = f"decoder.layers.{layer}."
        h = h + _attention(_rms(h, p[prefix + "input_layernorm.weight"], shape.eps), p,
                           prefix + "self_attention.", shape)
        h = h + _mlp(_rms(h, p[prefix + "pre_mlp_layernorm.weight"], shape.eps), p, prefix, shape)
    return _rms(h, p["decoder.final_layernorm.weight"], shape.eps) @ p["output_layer.weight"].T


def sample_loss(p: dict, ids: list[int], answer_mask: list[int], shape: Shape = TINY
                ) -> tuple[torch.Tensor, int]:
    """(sum of target-token cross entropies, number of targets) of one sample of ids alone.

    Tokens ``ids[:-1]``, labels ``ids[1:]``, a target where ``answer_mask[1:]`` is 1.
    """
    out = logits(p, ids[:-1], shape)
    losses = F.cross_entropy(out, torch.as_tensor(ids[1:]), reduction="none")
    keep = torch.as_tensor(answer_mask[1:], dtype=torch.bool)
    return losses[keep].sum(), int(keep.sum())
