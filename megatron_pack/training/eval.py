"""Validation loss: the training step's forward on validation packs, no backward, every layout.

The validation set is a prepared plan of its own (``data.validation``, prepared into
``<data.dataset_dir>/validation``) or the share of the training store held out before packing
(``data.validation_fraction``, the plan's ``validation/`` sub-plan). An evaluation reads the
first ``train.eval_iters * train.global_batch_size`` validation packs (all of them when
``train.eval_iters=0``), always the same ones, dealt round-robin over DP ranks (pack i to DP
rank ``i % dp``; every CP and TP rank of a DP rank reads the same packs, CP ranks their slice).

It runs ``forward_step`` (the training forward: CP slice, ``PackedSeqParams``, per-token
losses) under ``torch.no_grad()`` in eval mode and reduces once over DP x CP in float64::

    validation loss = sum of every target token's loss / number of target tokens

so it does not depend on the layout (a DP rank with fewer packs contributes fewer tokens, not
a different weight). Forward passes have no DP collective, so DP ranks may hold different
numbers of packs; every rank enters the one reduction.

The reduction is keyed by group name (today only ``"all"``), so a per-source breakdown adds
groups without changing the collective pattern: every rank reduces the same key list.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

log = logging.getLogger("megatron_pack.train")


@dataclass
class EvalResult:
    """Global validation numbers of one evaluation."""

    loss: float
    """Token-weighted validation loss (0.0 when no validation token carries loss)."""
    target_tokens: int
    num_packs: int
    by_group: dict[str, float] = field(default_factory=dict)
    """Validation loss per group (``"all"`` equals ``loss``)."""


def open_validation(cfg, train_dataset=None):
    """The validation ``PackedSFTDataset`` of ``cfg`` or None when it has none.

    ``data.validation``: the plan prepared in ``<data.dataset_dir>/validation`` with the training
    plan's settings; ``data.validation_fraction``: the ``validation`` sub-plan of the training
    plan (``train_dataset``'s, opened from ``cfg`` when not given). Raises ``DataError`` naming
    the prepare command when it is missing.
    """
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.formats.sources import DataError
    from megatron_pack.data.store.metadata import VALIDATION_DIRNAME

    if cfg.data.validation is not None:
        from megatron_pack.data.prepare import validation_config

        return PackedSFTDataset.from_config(validation_config(cfg))
    if not cfg.data.validation_fraction:
        return None
    train_dataset = train_dataset or PackedSFTDataset.from_config(cfg)
    plan_dir = Path(train_dataset.plan_dir) / VALIDATION_DIRNAME
    if not (plan_dir / "metadata.json").is_file():
        raise DataError(f"the packing plan {train_dataset.plan_dir} has no held-out validation plan for "
                        f"data.validation_fraction={cfg.data.validation_fraction}; re-run `megatron-pack prepare` "
                        "with the same config.")
    return PackedSFTDataset(train_dataset.dataset_dir, plan_dir, expected_tokenizer=cfg.data.tokenizer)


def num_eval_packs(num_packs: int, eval_iters: int, global_batch_size: int) -> int:
    """Validation packs per evaluation: ``eval_iters`` global batches, at most all of them (0 = all).

    >>> num_eval_packs(10, 0, 4), num_eval_packs(10, 2, 4), num_eval_packs(10, 3, 4)
    (10, 8, 10)
    """
    return num_packs if eval_iters == 0 else min(num_packs, eval_iters * global_batch_size)


class ValidationLoader:
    """This DP rank's share of the first ``num_packs`` validation packs, as THD batches, in order."""

    def __init__(self, dataset, collate: Callable, *, num_packs: int, dp_rank: int, dp_size: int):
        self.dataset, self.collate = dataset, collate
        self.indices = list(range(dp_rank, num_packs, dp_size))
        self.num_packs = num_packs

    def __iter__(self):
        for i in self.indices:
            yield self.collate(self.dataset[i])

    def __len__(self) -> int:
        return len(self.indices)


def build_validation_loader(cfg, state, dataset) -> Optional[ValidationLoader]:
    """The validation loader for ``dataset`` (None passes through), collated like training packs."""
    if dataset is None:
        return None
    from megatron_pack.data.batches.loader import collate_from_config

    collate = collate_from_config(cfg, dataset.metadata)
    num = num_eval_packs(len(dataset), cfg.train.eval_iters, cfg.train.global_batch_size)
    return ValidationLoader(dataset, collate, num_packs=num, dp_rank=state.dp_rank, dp_size=state.dp_size)


def _unwrapped_forward(model: torch.nn.Module, forward_step_func: Callable, batch: dict):
    output, loss_fn = forward_step_func(iter([batch]), model)
    _, _, report = loss_fn(output)
    return report["lm loss"].double().cpu()


def evaluate(model: torch.nn.Module, batches: Iterable[dict], *, forward_step_func: Callable,
             group: Optional[dist.ProcessGroup], num_packs: int = 0,
             group_of: Optional[Callable[[dict], str]] = None, groups: tuple[str, ...] = ("all",)) -> EvalResult:
    """Token-weighted validation loss of ``batches`` (this rank's packs), reduced over ``group`` (DP x CP).

    ``group_of(batch)`` names the group a pack counts towards besides ``"all"`` (for a
    per-source breakdown); ``groups`` lists every group name, the same on every rank.
    """
    sums = torch.zeros(len(groups), 2, dtype=torch.float64)
    index = {name: i for i, name in enumerate(groups)}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                report = _unwrapped_forward(model, forward_step_func, batch)
                sums[index["all"]] += report
                if group_of is not None and group_of(batch) in index and group_of(batch) != "all":
                    sums[index[group_of(batch)]] += report
    finally:
        model.train(was_training)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    losses = {name: float(sums[i, 0] / sums[i, 1]) if sums[i, 1] > 0 else 0.0 for name, i in index.items()}
    return EvalResult(loss=losses["all"], target_tokens=int(round(float(sums[index["all"], 1]))),
                      num_packs=num_packs, by_group=losses)
