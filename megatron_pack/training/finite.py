"""Are the weights finite? Checked on load and whenever a step's loss is not, on every rank together.

A NaN in the weights makes every loss NaN, and a message naming the step's samples then blames
the data. So:

- after the weights are loaded (``model.pretrained`` or a checkpoint), each rank checks its own
  shard, and the count of non-finite tensors is summed over the world: every rank stops together,
  and a rank that holds one names it (``rank 1: weights: decoder.layers.0.mlp.linear_fc2.weight of
  model.pretrained (DIR) holds 1 NaN and 0 Inf values; ...``);
- when a step's global loss is not finite, the same check runs first (``training.outcome``): non-finite
  weights are reported as **weights**, otherwise the pack's samples as **data**.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_pack.parallel.comm import all_reduce, group_size


class NonFiniteWeights(FloatingPointError):
    """A weight holds NaN or Inf; the message (one line) names the tensor on the rank that holds it."""


def nonfinite_parameters(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[tuple[str, int, int]]:
    """``(name, number of NaN, number of Inf)`` of every parameter of this rank's shard that is not finite;
    ``model`` is one model or this rank's model chunks (names then start ``chunk<i>.`` when there are several)."""
    from megatron_pack.training.chunks import core_model

    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    out = []
    with torch.no_grad():
        for i, chunk in enumerate(chunks):
            prefix = f"chunk{i}." if len(chunks) > 1 else ""
            for name, param in core_model(chunk).named_parameters():
                if not bool(torch.isfinite(param).all()):
                    num_nan = int(torch.isnan(param).sum())
                    out.append((prefix + name, num_nan, int(param.numel() - torch.isfinite(param).sum()) - num_nan))
    return out


def world_count(count: int, device: torch.device) -> int:
    """``count`` summed over every rank of the world (every rank must call it)."""
    if group_size(None) == 1:
        return count
    total = torch.tensor([count], dtype=torch.int64, device=device)
    return int(all_reduce(total).item())


def check_weights(model: torch.nn.Module | Sequence[torch.nn.Module], *, where: str, device: torch.device, source: str,
                  fix: str) -> None:
    """Raise ``NonFiniteWeights`` on every rank when any rank's shard holds NaN or Inf (collective).

    ``where`` starts the line (``rank 1`` or ``step 3, rank 1``); ``source`` says where the weights
    came from (``model.pretrained (DIR)``, a checkpoint, the optimizer step before); ``fix`` what to do."""
    bad = nonfinite_parameters(model)
    if world_count(len(bad), device) == 0:
        return
    if bad:
        name, num_nan, num_inf = bad[0]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise NonFiniteWeights(f"{where}: weights: {name} of {source} holds {num_nan} NaN and {num_inf} Inf "
                               f"values{more}; the weights are not finite (not the data): {fix}.")
    raise NonFiniteWeights(f"{where}: weights: the shard of another rank of {source} is not finite (named in "
                           f"that rank's line); {fix}.")
