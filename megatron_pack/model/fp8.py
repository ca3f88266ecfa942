"""``model.fp8``: Transformer Engine FP8 recipes for the linear layers, with padding kept out of them.

Two things, both only on the Transformer Engine backend (GPU):

* ``fp8_config_kwargs(recipe)``: megatron-core ``TransformerConfig`` settings for the recipe
  (``fp8`` format and ``fp8_recipe``); megatron-core then runs every TE linear layer under
  ``te.fp8_autocast`` with the recipe (``megatron.core.fp8_utils.get_fp8_recipe``)::

      delayed   -> fp8="hybrid", fp8_recipe="delayed"      (DelayedScaling, amax history)
      current   -> fp8="hybrid", fp8_recipe="tensorwise"   (Float8CurrentScaling)
      mxfp8     -> fp8="e4m3",   fp8_recipe="mxfp8"        (MXFP8BlockScaling, Blackwell)
      blockwise -> fp8="e4m3",   fp8_recipe="blockwise"    (Float8BlockScaling, Hopper, CUDA >= 12.9)

* ``zero_padding_rows(model, cp_size, cp_rank, tp_size, tp_rank)``: hooks that keep every padded
  row (the sub-sequences' alignment padding and the pack's tail) exactly zero at the input of
  every FP8 GEMM, forward and backward, so no recipe's statistics see it. Every recipe keeps only
  maxima of absolute values (the amax history of delayed scaling, the per-tensor amax of current
  scaling, the per-block amax of MXFP8 and blockwise), and ``max|x|`` over a tensor whose padded
  rows are 0 equals ``max|x|`` over its real rows, bit for bit. How the rows stay zero:

  - the embedding output is zeroed on padded rows (``torch.where`` on the rows of
    ``parallel.cp.thd_real_token_mask``), so the residual stream starts at 0 there;
  - RMSNorm maps a zero row to zero (``validate`` refuses FP8 with LayerNorm, whose bias would
    not), and the linears have no bias (``add_bias_linear=False``), so fc1/fc2/qkv inputs stay 0;
  - core attention's query/key/value and output are zeroed on padded rows: the output is what
    linear_proj reads, and zeroing the inputs makes the gradients flowing back into linear_qkv 0
    there whatever the kernel leaves in padded rows (TE 2.20 zero-fills them for THD itself,
    ``pytorch/csrc/extensions/attention.cpp``; older versions and other backends need not);
  - the loss mask is 0 on padding, so the gradients entering the model are 0 on padded rows.

  The masks are computed on the device from ``packed_seq_params`` inside each forward (no host
  sync), so a captured CUDA graph recomputes them on replay. Real rows are untouched (``where``
  keeps them), so real rows compute exactly what they would without the hooks.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_pack.config.choices import FP8_RECIPES
from megatron_pack.parallel.cp import thd_real_token_mask

MCORE_FP8 = {"delayed": ("hybrid", "delayed"), "current": ("hybrid", "tensorwise"),
             "mxfp8": ("e4m3", "mxfp8"), "blockwise": ("e4m3", "blockwise")}
"""``model.fp8`` -> megatron-core ``(TransformerConfig.fp8, TransformerConfig.fp8_recipe)``."""

_TE_SUPPORT = {"delayed": "check_fp8_support", "current": "check_fp8_support", "mxfp8": "check_mxfp8_support",
               "blockwise": "check_fp8_block_scaling_support"}
"""Transformer Engine's own check of each recipe on this GPU (``(bool, reason)``)."""

assert set(MCORE_FP8) | {"none"} == set(FP8_RECIPES), "every model.fp8 value needs a megatron-core mapping"


def fp8_config_kwargs(recipe: str) -> dict:
    """megatron-core ``TransformerConfig`` kwargs for ``model.fp8`` (empty for 'none').

    FP8 attention (``fp8_dot_product_attention``) stays off: attention runs in the model's dtype,
    only the linear layers' GEMMs are FP8. The weights stay in their dtype (``fp8_param`` off).
    """
    if recipe == "none":
        return {}
    fmt, name = MCORE_FP8[recipe]
    return {"fp8": fmt, "fp8_recipe": name}


def te_recipe_problem(recipe: str) -> Optional[str]:
    """None when Transformer Engine can run ``recipe`` on this GPU, else its reason (one line)."""
    try:
        from transformer_engine.pytorch import quantization as q  # TE >= 2.8
    except ImportError:
        try:
            from transformer_engine.pytorch import fp8 as q  # older TE
        except ImportError as exc:
            return f"Transformer Engine does not import ({exc})"
    check = getattr(q, _TE_SUPPORT[recipe], None)
    if check is None:
        return f"this Transformer Engine has no {_TE_SUPPORT[recipe]} (too old for model.fp8={recipe})"
    ok, reason = check()
    return None if ok else (reason or f"Transformer Engine cannot run model.fp8={recipe} on this GPU")


def _rows_first(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x`` with the rows (dim 0) where ``keep`` is False set to 0; other rows untouched."""
    shape = (keep.numel(),) + (1,) * (x.dim() - 1)
    return torch.where(keep.view(shape), x, torch.zeros((), dtype=x.dtype, device=x.device))


def zero_padding_rows(model: torch.nn.Module, *, cp_size: int, cp_rank: int, tp_size: int = 1, tp_rank: int = 0,
                      sequence_parallel: bool = False) -> list:
    """Install the hooks of the module docstring on a megatron-core ``GPTModel``; returns their handles.

    The embedding's output is [S, B, H] (S = this CP rank's T/CP rows), or this TP rank's
    contiguous S/TP rows with sequence parallelism; core attention sees [T/CP, heads, dim] THD
    tensors. Both read the rows' real/padded state from ``packed_seq_params`` of that forward.
    """
    state: dict = {}

    def remember(module, args, kwargs):  # GPTModel.forward(input_ids, position_ids, attention_mask, ...)
        params = kwargs.get("packed_seq_params")
        state["keep"] = None
        if params is not None and params.cu_seqlens_q_padded is not None:
            num_local = args[0].shape[-1] if args else kwargs["input_ids"].shape[-1]
            state["keep"] = thd_real_token_mask(params.cu_seqlens_q, params.cu_seqlens_q_padded, num_local,
                                                cp_size, cp_rank)

    def embedding_out(module, args, output):
        keep = state.get("keep")
        if keep is None:
            return output
        if sequence_parallel and tp_size > 1:
            rows = keep.numel() // tp_size
            keep = keep[tp_rank * rows:(tp_rank + 1) * rows]
        return _rows_first(output, keep)

    def padded_params(kwargs):
        """The forward's ``packed_seq_params`` when its pack has padding, else None."""
        params = kwargs.get("packed_seq_params")
        return params if params is not None and params.cu_seqlens_q_padded is not None else None

    def attention_in(module, args, kwargs):
        params = padded_params(kwargs)
        if params is None:
            return None
        keep = thd_real_token_mask(params.cu_seqlens_q, params.cu_seqlens_q_padded, args[0].shape[0], cp_size, cp_rank)
        state["attention_keep"] = keep
        return tuple(_rows_first(a, keep) if i < 3 else a for i, a in enumerate(args)), kwargs

    def attention_out(module, args, kwargs, output):
        if padded_params(kwargs) is None:
            return output
        return _rows_first(output, state["attention_keep"])

    handles = [model.register_forward_pre_hook(remember, with_kwargs=True),
               model.embedding.register_forward_hook(embedding_out)]
    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention
        handles.append(core.register_forward_pre_hook(attention_in, with_kwargs=True))
        handles.append(core.register_forward_hook(attention_out, with_kwargs=True))
    return handles
