"""Transformer Engine's THD attention, told that our sub-sequences are padded (``pad_between_seqs``).

Every sub-sequence of a pack is padded at its tail to the pad multiple (``lcm(2*CP, CP*TP)``), so the real
boundaries (``cu_seqlens``) and the physical ones (``cu_seqlens_padded``) differ. Transformer Engine decides
from its arguments whether there is padding between sequences when the caller does not say; with
``qkv_format="thd"``, CP p2p and tail-padded sub-sequences it can take the ``pad_between_seqs=False`` path, which
approximates each CP step's lengths as ``cu_seqlens // cp_size``: real query rows come out exactly 0 and gradients
vary from run to run (TE issue #3331, reported on TE 2.16.0 and 2.17.1; passing ``pad_between_seqs=True`` fixed it).
megatron-core 0.16.1's ``PackedSeqParams`` has no such field and its ``TEDotProductAttention`` never passes one, so
the TE layer spec's core attention is ``padded_thd_attention_class()``: megatron-core's class with one step
between it and TE's ``DotProductAttention`` that adds the argument.

The rule: ``pad_between_seqs=True`` whenever ``cu_seqlens_q_padded`` reaches TE (``training.step`` passes it only
when the pack has padding, or always under CUDA graphs, where True is exact too: it only selects TE's padded path);
False when it does not (the real and physical boundaries are the same). Example, CP=2 (pad multiple 4):
``cu_seqlens=[0,5,11]``, ``cu_seqlens_padded=[0,8,12]`` -> TE gets ``pad_between_seqs=True`` with both arrays.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

PAD_BETWEEN_SEQS = "pad_between_seqs"


def pad_between_seqs(kwargs: dict[str, Any]) -> Optional[bool]:
    """What to tell TE for the keyword arguments megatron-core passes it (None: not a THD call, say nothing)."""
    if kwargs.get("qkv_format") != "thd":
        return None
    return kwargs.get("cu_seqlens_q_padded") is not None or kwargs.get("cu_seqlens_kv_padded") is not None


def te_attention_problem(te_dot_product_attention: type) -> Optional[str]:
    """Why this TE's ``DotProductAttention`` cannot be told about padding (None: it can)."""
    if PAD_BETWEEN_SEQS not in inspect.signature(te_dot_product_attention.forward).parameters:
        return ("this Transformer Engine's DotProductAttention.forward takes no pad_between_seqs, which THD packs "
                "with padded sub-sequences need; install megatron_pack[gpu] (the versions setup.py names).")
    return None


def padded_thd_attention_class(mcore_te: Any = None) -> type:
    """megatron-core's ``TEDotProductAttention`` that tells TE ``pad_between_seqs`` (see the module docstring).

    ``mcore_te`` is megatron-core's ``extensions.transformer_engine`` module (the default), or, in a test, that
    module executed against a stand-in for TE. Its ``TEDotProductAttention.forward`` builds TE's keyword arguments
    from ``packed_seq_params`` and calls ``super().forward``: the class in between adds the argument, so nothing
    of megatron-core's forward is copied here. One class per (megatron-core class, TE class)."""
    if mcore_te is None:
        from megatron.core.extensions import transformer_engine as mcore_te
    return _padded_class(mcore_te.TEDotProductAttention, mcore_te.te.pytorch.DotProductAttention)


@functools.cache
def _padded_class(base: type, te_attention: type) -> type:
    problem = te_attention_problem(te_attention)
    if problem:
        from megatron_pack.config.schema import ConfigError

        raise ConfigError([f"model.attention_backend (te): {problem}"])

    class TellsTEAboutPadding(te_attention):
        """TE's ``DotProductAttention`` with ``pad_between_seqs`` set from the THD arguments it receives."""

        def forward(self, *args, **kwargs):
            told = pad_between_seqs(kwargs)
            if told is not None:
                kwargs.setdefault(PAD_BETWEEN_SEQS, told)
            return super().forward(*args, **kwargs)

    class PaddedTHDAttention(base, TellsTEAboutPadding):
        """megatron-core's TE attention; the call into TE says whether the THD pack has padding."""

    return PaddedTHDAttention
