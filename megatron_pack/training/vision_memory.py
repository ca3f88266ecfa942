"""The vision tower's share of the memory estimate (``memory_estimate``), from config.json's ``vision_config``.

Torch-free. The tower (Qwen2.5-VL's, transformers' module; Qwen3-VL's and Qwen3.5's in ``vision_params``) sits on
the first pipeline stage, whole on every TP and CP rank. Its parameters, per the module's layout, for hidden ``v``,
MLP width ``f``, ``c`` input channels, temporal patch ``t``, patch ``p``, spatial merge ``m`` and output (language)
width ``o``:

- patch embedding (a convolution without bias): ``v * c * t * p * p``;
- each block: two RMSNorms ``2 v``, qkv ``3 v * v + 3 v``, proj ``v * v + v``, gate/up ``2 (f v + f)``,
  down ``v f + v``;
- the merger: an RMSNorm ``v`` and two linears on ``u = v m^2``: ``u * u + u`` and ``o u + o``.

The tiny test tower (v 32, f 64, c 3, t 2, p 14, m 2, o 64, depth 2) has 37,632 + 2 x 10,592 + 24,800 =
83,616 parameters. With ``model.freeze_vision`` only the merger trains (gradients and optimizer state for
it alone) and autograd keeps only the merger's activations; otherwise every block's too. Activations are
taken at the worst pack, one whose tokens are all image tokens: ``m^2`` patches per image token, for the
whole pack on every CP rank (the tower runs the pack's images replicated); per patch and block
``8 v + 3 f`` elements (norm and linear inputs, q, k, v, attention output, the MLP's SwiGLU working set),
per image token in the merger ``2 u + o``.
"""

from __future__ import annotations

from typing import Any, Optional


def vision_config(cfg) -> Optional[dict[str, Any]]:
    """config.json's ``vision_config`` of a vision-language ``model.pretrained`` (None for a text model)."""
    if cfg.model.mrope_section is None or cfg.model.pretrained is None:
        return None
    from megatron_pack.config.hf_config import read_hf_config

    return read_hf_config(cfg.model.pretrained).get("vision_config")


def _sizes(vc: dict) -> tuple[int, int, int, int]:
    v, f, m = int(vc["hidden_size"]), int(vc["intermediate_size"]), int(vc.get("spatial_merge_size", 2))
    return v, f, v * m * m, int(vc["out_hidden_size"])


def _qwen3_tower(vc: dict) -> bool:
    """Qwen3-VL's / Qwen3.5's tower (a learned position grid, LayerNorms, a plain GELU MLP, DeepStack mergers),
    not Qwen2.5-VL's."""
    return "num_position_embeddings" in vc


def _num_deepstack(vc: dict) -> int:
    return len(vc.get("deepstack_visual_indexes") or [])


def merger_params(vc: dict) -> int:
    """The merger's parameters (Qwen3-VL: with its DeepStack mergers, which train with it)."""
    v, _, u, o = _sizes(vc)
    if _qwen3_tower(vc):  # LayerNorm (weight and bias) over v; each DeepStack merger's over u
        return 2 * v + u * u + u + o * u + o + _num_deepstack(vc) * (2 * u + u * u + u + o * u + o)
    return v + u * u + u + o * u + o


def vision_params(vc: dict) -> int:
    """Every parameter of the tower and merger (see the module docstring). Qwen3-VL / Qwen3.5: the patch
    convolution has a bias, a learned position grid of ``num_position_embeddings`` rows, blocks with two LayerNorms
    and a plain MLP ``f v + f``, ``v f + v``; the tiny Qwen3-VL test tower (v 32, f 64, p 16, grid 16, depth 2,
    two DeepStack levels) has 49,184 + 512 + 2 x 8,544 + 24,832 + 2 x 25,024 = 141,664."""
    v, f, _, _ = _sizes(vc)
    channels = int(vc.get("in_channels", vc.get("in_chans", 3)))
    patch = v * channels * int(vc.get("temporal_patch_size", 2)) * int(vc["patch_size"]) ** 2
    if _qwen3_tower(vc):
        block = 4 * v + 3 * v * v + 3 * v + v * v + v + f * v + f + v * f + v
        return patch + v + int(vc["num_position_embeddings"]) * v + int(vc["depth"]) * block + merger_params(vc)
    block = 2 * v + 3 * v * v + 3 * v + v * v + v + 2 * (f * v + f) + v * f + v
    return patch + int(vc["depth"]) * block + merger_params(vc)


def vision_trainable_params(vc: dict, frozen: bool) -> int:
    """The parameters that train: the merger with ``model.freeze_vision``, else all."""
    return merger_params(vc) if frozen else vision_params(vc)


def vision_activation_bytes(cfg, vc: dict, element: int) -> int:
    """Activation bytes of the tower for one pack of image tokens only (see the module docstring)."""
    v, f, u, o = _sizes(vc)
    image_tokens = cfg.packing.packed_sequence_size if cfg.packing.mode != "in_batch" else cfg.model.seq_length
    merge = int(vc.get("spatial_merge_size", 2)) ** 2
    blocks = 0 if cfg.model.freeze_vision else int(vc["depth"]) * image_tokens * merge * (8 * v + 3 * f)
    return element * (blocks + (1 + _num_deepstack(vc)) * image_tokens * (2 * u + o))
