"""The THD batch of a ``wrapped_attention=cross`` row: one sequence, attention across documents.

A cross row is planned without alignment padding between its document pieces (the plan's
``wrapped_attention`` is ``cross``). It is collated as usual, then merged into one sub-sequence:
``cu_seqlens = [0, R]`` (R real tokens), padded as a whole to the pad multiple, position ids
``0 .. T-1`` across the row. Labels and the loss mask are unchanged, so labels still never cross
a document (a document's last position predicts its own eos); only attention crosses.

Example, pieces ``[A, B, EOS]`` and ``[C, D, EOS]``, pad multiple 1: tokens ``[A, B, C, D]``,
labels ``[B, EOS, D, EOS]``, position_ids ``[0, 1, 2, 3]``, cu_seqlens ``[0, 4]`` (document mode
would give ``[0, 2, 4]`` and positions ``[0, 1, 0, 1]``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from megatron_pack.config.layout import round_up
from megatron_pack.data.batches.thd import _fixed_length, collate_thd


def collate_cross(samples: Sequence[Mapping[str, Any]], *, pack_size: int, pad_multiple: int = 1,
                  pad_to_max_length: bool = False, num_cu_seqlens: Optional[int] = None, pad_id: int = 0,
                  max_seqlen: Optional[int] = None) -> dict:
    """One cross row -> a THD batch with a single sequence (plus the padding tail with ``pad_to_max_length``)."""
    pieces = collate_thd(samples, pack_size=pack_size, pad_multiple=1, pad_id=pad_id)
    real = int(pieces["cu_seqlens"][-1])
    padded = round_up(real, pad_multiple)
    total = pack_size if pad_to_max_length else padded
    out = {}
    for key in ("tokens", "labels", "loss_mask"):
        fill = 0 if key == "loss_mask" else pad_id
        value = torch.full((1, total), fill, dtype=pieces[key].dtype)
        value[0, :real] = pieces[key][0, :real]
        out[key] = value
    cu_real, cu_padded = [0, real], [0, padded]
    if total > padded:  # the tail after the row: one more sub-sequence of zero real length
        cu_real, cu_padded = cu_real + [real], cu_padded + [total]
    sample_ids = pieces["sample_ids"].numpy()
    out["position_ids"] = (torch.arange(total) - torch.tensor(np.repeat(cu_padded[:-1], np.diff(cu_padded)))).unsqueeze(0)
    out["cu_seqlens"] = torch.from_numpy(_fixed_length(np.array(cu_real), num_cu_seqlens, sample_ids).astype(np.int32))
    out["cu_seqlens_padded"] = torch.from_numpy(
        _fixed_length(np.array(cu_padded), num_cu_seqlens, sample_ids).astype(np.int32))
    longest = int(np.diff(cu_padded).max())
    out["max_seqlen"] = int(max_seqlen if max_seqlen is not None and max_seqlen >= longest else
                            (pack_size if num_cu_seqlens is not None else longest))
    out["sample_ids"] = pieces["sample_ids"]
    out.update(num_real_tokens=real, num_pad_tokens=total - real, num_target_tokens=pieces["num_target_tokens"])
    return out
