"""Layer features a family record names beyond megatron-core's GPT layer (Gemma 3), each one small module or hook.

* ``add_post_norms(model)``: every layer's ``self_attention`` and ``mlp`` output goes through an RMSNorm
  (``post_layernorm``) before the residual add (``model.post_norms``; Gemma 3's post_attention_layernorm and
  post_feedforward_layernorm). Under sequence parallelism it normalises the rank's own tokens, like every norm.
* ``use_local_rope(model, base)``: the windowed layers (megatron-core's ``is_layer_window_attention``) rotate by
  ``model.rotary_base_local`` instead of the model's RoPE (``model.rotary_base`` with ``model.rope_scaling``).
  Each windowed layer's attention receives the model's frequencies ``[s, 1, 1, dim]``, whose first column is
  ``position / interpolation factor`` (its inverse frequency is 1), and rebuilds them from those positions with
  its own base: no state is kept between calls, so recomputation and pipeline schedules see the same values.
  Example: base 10000, dim 4, positions [0, 1] -> inverse frequencies [1, 0.01], rows [0, 0, 0, 0] and
  [1, 0.01, 1, 0.01].
* ``scale_embeddings(model)``: the embedding output times ``sqrt(hidden_size)`` rounded to its dtype
  (``model.scale_embeddings``; transformers' Gemma3TextScaledWordEmbedding).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from megatron_pack.model.norms import SequenceParallelNorm


class PostNorm(SequenceParallelNorm):
    """The post-norm: a ``SequenceParallelNorm`` that describes itself to megatron-core's checkpoints (its ``MLP``
    asks every child for ``sharded_state_dict``): replicated over TP, like the other norms."""

    def __init__(self, *args, tp_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp_group = tp_group

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


def add_post_norms(model) -> int:
    """Give every layer's ``self_attention`` and ``mlp`` a ``post_layernorm`` applied to its output (a forward hook:
    megatron-core's own modules and their LoRA adapters stay as they are); returns how many norms were added."""
    added = 0
    for layer in model.decoder.layers:
        for block in (layer.self_attention, layer.mlp):
            config = block.config
            block.post_layernorm = PostNorm(config, config.hidden_size, eps=config.layernorm_epsilon,
                                            tp_group=block.tp_group)
            block.register_forward_hook(_post_norm_hook)
            added += 1
    return added


def _post_norm_hook(module, args, output):
    out, bias = output
    if bias is not None:
        raise ValueError("model.post_norms needs linear layers without bias (the norm comes before it).")
    return module.post_layernorm(out), bias


def local_rope_frequencies(freqs: Tensor, inv_freq: Tensor, interpolation: float, interleaved: bool) -> Tensor:
    """The windowed layers' RoPE frequencies [s, 1, 1, dim] at the positions of the model's ``freqs``."""
    positions = torch.round(freqs[:, 0, 0, 0].float() * interpolation)
    local = torch.outer(positions, inv_freq.to(device=freqs.device))
    if interleaved:
        emb = torch.stack((local.reshape(-1, 1), local.reshape(-1, 1)), dim=-1).view(local.size(0), -1)
    else:
        emb = torch.cat((local, local), dim=-1)
    return emb[:, None, None, :].to(freqs.dtype)


def use_local_rope(model, base: int) -> int:
    """Rotate the windowed layers of ``model`` (a ``GPTModel`` chunk) by RoPE base ``base``; returns how many."""
    from megatron.core.transformer.utils import is_layer_window_attention

    config, rope = model.config, model.rotary_pos_emb
    dim = rope.inv_freq.numel() * 2
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    hook = functools.partial(_local_rope_hook, inv_freq, float(rope.seq_len_interpolation_factor or 1.0),
                             bool(config.rotary_interleaved))
    windowed = [layer for layer in model.decoder.layers
                if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer.layer_number)]
    for layer in windowed:
        layer.self_attention.register_forward_pre_hook(hook, with_kwargs=True)
    return len(windowed)


def _local_rope_hook(inv_freq, interpolation, interleaved, module, args, kwargs):
    freqs = kwargs.get("rotary_pos_emb")
    if freqs is None:
        return None
    if not isinstance(freqs, Tensor):
        raise ValueError("model.rotary_base_local needs one RoPE tensor for queries and keys.")
    return args, {**kwargs, "rotary_pos_emb": local_rope_frequencies(freqs, inv_freq, interpolation, interleaved)}


def scale_embeddings(model) -> None:
    """Multiply ``model.embedding``'s output by sqrt(hidden_size) in its dtype (first pipeline stage only)."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return
    scale = math.sqrt(model.config.hidden_size)
    embedding.register_forward_hook(lambda module, args, out: out * torch.tensor(scale, dtype=out.dtype))
