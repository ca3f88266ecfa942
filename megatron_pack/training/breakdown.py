"""Per-source loss and per-bucket tokens: the breakdowns of a step's (or an evaluation's) numbers.

``per_source_loss`` is the one function training and evaluation call: from per-token losses,
the loss mask and each token's source (``token_source`` of a data.sources batch, -1 on padding)
it gives, per source, the loss sum and the number of target tokens. Summing those over
micro-batches and ranks and dividing gives each source's token-weighted loss, exactly as the
global ``lm loss`` is formed (so the per-source losses, weighted by their token counts, average
to the lm loss).

Example: losses ``[1.0, 2.0, 4.0, 8.0]``, mask ``[1, 1, 1, 0]``, sources ``[0, 1, 1, -1]``, two
sources -> sums ``[1.0, 6.0]``, counts ``[1, 2]``: source 0 loss 1.0, source 1 loss 3.0.
"""

from __future__ import annotations

import torch


def per_source_loss(token_loss: torch.Tensor, loss_mask: torch.Tensor, token_source: torch.Tensor,
                    num_sources: int) -> torch.Tensor:
    """float64 [2, num_sources]: row 0 the loss sums, row 1 the target-token counts (detached).

    Masked positions are dropped before summing, so inf / NaN there never leaks into a sum.
    """
    losses = token_loss.detach().double().reshape(-1)
    keep = (loss_mask.reshape(-1) != 0) & (token_source.reshape(-1) >= 0)
    source = token_source.reshape(-1).to(losses.device).long()
    index = torch.where(keep, source, torch.zeros_like(source))
    out = torch.zeros(2, num_sources, dtype=torch.float64, device=losses.device)
    out[0].index_add_(0, index, torch.where(keep, losses, torch.zeros_like(losses)))
    out[1].index_add_(0, index, keep.double())
    return out


def source_metrics(sums_counts: list[float], names: list[str]) -> tuple[dict, dict]:
    """``(loss per source, share of target tokens per source)`` from summed ``[sums..., counts...]``.

    A source without target tokens this step has loss ``None`` (not 0: nothing was measured).
    """
    n = len(names)
    sums, counts = sums_counts[:n], sums_counts[n:2 * n]
    total = sum(counts)
    loss = {name: (s / c if c > 0 else None) for name, s, c in zip(names, sums, counts)}
    share = {name: (c / total if total > 0 else 0.0) for name, c in zip(names, counts)}
    return loss, share
