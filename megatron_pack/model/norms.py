"""Sequence-parallel-capable RMSNorm / LayerNorm for megatron-core's local layer spec.

megatron-core's torch norm wrapper (``WrappedTorchNorm``) refuses ``sequence_parallel``. Under
sequence parallelism each TP rank normalises only its own slice of the sequence, so the norm's
weight (and bias) gradients are partial sums: megatron-core's ``finalize_model_grads``
all-reduces over the TP group exactly the parameters that carry the attribute
``sequence_parallel = True``. ``SequenceParallelNorm`` is a plain per-token norm that sets that
attribute, which is all megatron needs (the same contract its apex / TE norms follow).

Example: TP=2 with SP, a pack of T=8 tokens: rank 0 normalises tokens 0-3, rank 1 tokens 4-7;
after backward each rank's ``weight.grad`` holds the sum over its 4 tokens, and the TP
all-reduce turns both into the sum over all 8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_pack.config.choices import NORMALIZATIONS


class SequenceParallelNorm(torch.nn.Module):
    """RMSNorm or LayerNorm (``config.normalization``) whose parameters carry ``sequence_parallel``.

    Signature matches megatron-core's norm modules so it can be used as the ``input_layernorm``,
    ``pre_mlp_layernorm`` and final ``layer_norm`` of a ``ModuleSpec``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str | None = None):
        super().__init__()
        self.normalization = normalization or config.normalization
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"model.normalization ({self.normalization!r}) must be one of {list(NORMALIZATIONS)}.")
        # zero-centred (Gemma): the norm scales by 1 + weight, so the stored weight starts at 0
        self.zero_centered = bool(config.layernorm_zero_centered_gamma or zero_centered_gamma)
        self.hidden_size, self.eps = hidden_size, eps
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter((torch.zeros if self.zero_centered else torch.ones)(hidden_size, dtype=dtype))
        self.bias = (torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
                     if self.normalization == "LayerNorm" else None)
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (self.hidden_size,), weight, self.eps)
        return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalization}, hidden_size={self.hidden_size}, eps={self.eps}"
                + (", scales by 1 + weight" if self.zero_centered else ""))
