"""RoPE by in-sequence position on the torch backend, whatever ``max_seqlen`` says.

megatron-core builds RoPE frequencies for ``max(max_seqlen_q, max_seqlen_kv)`` positions. Its
unfused THD path (the torch backend; Transformer Engine's fused kernel is not affected) then
picks a branch by that length: when it equals the pack's token count ``T``, it assumes the
frequencies cover *pack* positions and rotates every token of sub-sequence ``i`` by
``cu_seqlens_padded[i] + position``. Fixed shapes (``data.pad_to_max_length`` with
``packing.pad_cu_seqlens``) set ``max_seqlen = T``, so a sample placed after 8k tokens of others
was rotated as if it started at 8k: the same attention in exact arithmetic, but 1e-3 away from
itself alone in float32 logits (docs/reliability.md, section 4).

``InSequenceRotaryEmbedding`` sizes the frequencies by the longest padded sub-sequence of the
pack instead (a host-side read of ``cu_seqlens``, which the torch attention reads anyway), so the
offset branch is only taken when one sub-sequence fills the pack and its offset is 0.

Example: ``cu_seqlens_padded=[0, 8, 12, 24]``, ``max_seqlen=24`` -> frequencies for 12
positions; the three sub-sequences are rotated by 0..7, 0..3 and 0..11.
"""

from __future__ import annotations

from typing import Optional

import torch


def longest_sub_sequence(packed_seq_params) -> int:
    """The longest padded sub-sequence of a THD ``PackedSeqParams`` (q and kv), as a host int."""
    longest = 0
    for real, padded in ((packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded),
                         (packed_seq_params.cu_seqlens_kv, packed_seq_params.cu_seqlens_kv_padded)):
        cu = padded if padded is not None else real
        if cu is not None and cu.numel() > 1:
            longest = max(longest, int((cu[1:] - cu[:-1]).max()))
    return longest


def in_sequence_rotary_embedding_class() -> type:
    """megatron-core's ``RotaryEmbedding`` whose rotary length for THD packs is the longest sub-sequence."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class InSequenceRotaryEmbedding(RotaryEmbedding):
        """RoPE whose frequencies for a THD pack cover its longest padded sub-sequence (in-sequence positions)."""

        def get_rotary_seq_len(self, inference_context, transformer, transformer_input, transformer_config,
                               packed_seq_params=None, *, inference_params=None) -> int:
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                longest = longest_sub_sequence(packed_seq_params)
                if longest > 0:
                    return longest
            return super().get_rotary_seq_len(inference_context, transformer, transformer_input, transformer_config,
                                              packed_seq_params, inference_params=inference_params)

    return InSequenceRotaryEmbedding


_CLASS: Optional[type] = None


def use_in_sequence_rope(model: torch.nn.Module) -> None:
    """Make a torch-backend ``GPTModel`` rotate THD tokens by in-sequence position (see the module docstring).

    Changes the class of ``model.rotary_pos_emb`` in place (its state is kept); a model without
    RoPE is left alone. Not for the Transformer Engine backend: its fused RoPE already uses
    in-sequence positions and CUDA graphs need the fixed ``max_seqlen`` it is given.
    """
    global _CLASS
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        return
    if _CLASS is None:
        _CLASS = in_sequence_rotary_embedding_class()
    if not isinstance(rope, _CLASS):
        rope.__class__ = _CLASS


def yarn_inv_freq(inv_freq: torch.Tensor, model_cfg) -> torch.Tensor:
    """YaRN's frequencies from the plain ones (``inv_freq`` [head_dim / 2] = base ** (-2j / head_dim)), by
    megatron-core's YaRN helpers (the formula transformers' ``_compute_yarn_parameters`` uses): frequency j is
    kept where it turns more than ``beta_fast`` times over the original context, divided by
    ``model.rope_scaling_factor`` where it turns less than ``beta_slow`` times, blended linearly between.

    The attention factor YaRN multiplies cos and sin by is not here: it scales every attention logit by its
    square, which ``model.softmax_scale`` carries (``config.hf_config.families.yarn_keys``).
    """
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (_yarn_find_correction_range,
                                                                                   _yarn_linear_ramp_mask)

    m = model_cfg
    dim = 2 * inv_freq.numel()
    low, high = _yarn_find_correction_range(m.rope_yarn_beta_fast, m.rope_yarn_beta_slow, dim, m.rotary_base,
                                            m.rope_original_max_position_embeddings, m.rope_yarn_truncate)
    keep = 1 - _yarn_linear_ramp_mask(low, high, dim // 2, device=inv_freq.device).to(inv_freq.dtype)
    return inv_freq / m.rope_scaling_factor * (1 - keep) + inv_freq * keep
