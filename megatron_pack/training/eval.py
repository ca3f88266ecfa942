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

A validation plan of a mixed dataset (``data.sources``; its packs record each sample's source,
the batches carry ``token_source``) also gives each source's validation loss, formed exactly
as the total: per source, the loss sum and the target count of its tokens, summed over packs
and DP x CP in the same all-reduce, then divided::

    source s loss = sum of the losses of s's target tokens / number of s's target tokens

Example: two packs, one per DP rank; rank 0's holds targets of ``chat`` (losses 1 and 3) and
``code`` (2), rank 1's one ``code`` target (4): validation loss (1+3+2+4)/4 = 2.5, chat 2.0
(2 tokens, share 0.5), code 3.0 (2 tokens, share 0.5). The source names come from the dataset
metadata, so every rank reduces a vector of the same size whatever sources (or packs) it holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_pack.parallel.comm import all_reduce, broadcast, group_ranks, group_size

log = logging.getLogger("megatron_pack.train")


@dataclass
class EvalResult:
    """Global validation numbers of one evaluation."""

    loss: float
    """Token-weighted validation loss (0.0 when no validation token carries loss)."""
    target_tokens: int
    num_packs: int
    source_loss: dict[str, Optional[float]] = field(default_factory=dict)
    """Token-weighted validation loss per data.sources name (None for a source without a target;
    empty without data.sources)."""
    source_target_tokens: dict[str, int] = field(default_factory=dict)
    """Validation target tokens per data.sources name."""

    @property
    def source_target_share(self) -> dict[str, float]:
        """Each source's share of the validation target tokens."""
        return {name: (n / self.target_tokens if self.target_tokens else 0.0)
                for name, n in self.source_target_tokens.items()}


def num_eval_packs(num_packs: int, eval_iters: int, global_batch_size: int) -> int:
    """Validation packs per evaluation: ``eval_iters`` global batches, at most all of them (0 = all).

    >>> num_eval_packs(10, 0, 4), num_eval_packs(10, 2, 4), num_eval_packs(10, 3, 4)
    (10, 8, 10)
    """
    return num_packs if eval_iters == 0 else min(num_packs, eval_iters * global_batch_size)


class ValidationLoader:
    """This DP rank's share of the first ``num_packs`` validation packs, as THD batches, in order: a
    ``protocol.BatchLoader`` whose step is one evaluation (always the same packs, so nothing to resume)."""

    def __init__(self, dataset, collate: Callable, *, num_packs: int, dp_rank: int, dp_size: int):
        self.dataset, self.collate = dataset, collate
        self.indices = list(range(dp_rank, num_packs, dp_size))
        self.num_packs = num_packs

    @property
    def info(self):
        """The dataset's ``protocol.LoaderInfo`` (its source names give the per-source validation loss)."""
        from megatron_pack.data.batches.protocol import loader_info

        return loader_info(self.dataset.metadata)

    @property
    def source_names(self) -> list[str]:
        """The dataset's data.sources names (the same on every rank; empty for a single input)."""
        return list(self.info.source_names)

    def __iter__(self):
        for i in self.indices:
            yield self.collate(self.dataset[i])

    def __len__(self) -> int:
        return len(self.indices)

    def begin_step(self):
        """One evaluation: this rank's validation packs."""
        from megatron_pack.data.batches.protocol import StepInfo

        return StepInfo(num_microbatches=len(self.indices))

    def state_dict(self) -> dict:
        return {"kind": "validation", "num_packs": self.num_packs}

    def load_state_dict(self, state) -> None:
        if state.get("kind") != "validation" or state.get("num_packs") != self.num_packs:
            raise ValueError(f"loader state {dict(state)!r} is not this validation loader's ({self.num_packs} packs).")

    @property
    def epoch(self) -> float:
        return 0.0  # every evaluation reads the same packs: no position to move

    @property
    def packs_per_epoch(self) -> int:
        return self.num_packs

    def num_steps(self, num_epochs: int) -> int:
        return num_epochs


def build_validation_loader(cfg, state, dataset) -> Optional[ValidationLoader]:
    """The validation loader for ``dataset`` (None passes through), collated like training packs."""
    if dataset is None:
        return None
    from megatron_pack.data.batches.loader import dataset_collate

    collate = dataset_collate(cfg, dataset)
    num = num_eval_packs(len(dataset), cfg.train.eval_iters, cfg.train.global_batch_size)
    return ValidationLoader(dataset, collate, num_packs=num, dp_rank=state.dp_rank, dp_size=state.dp_size)


def _reports(chunks: list[torch.nn.Module], forward_step_func: Callable, batches: Iterable[dict],
             schedule: Callable):
    """(batch, report) of every batch whose loss this rank holds (every batch without a pipeline;
    on the last stage with one, none on the others): the forwards of the training schedule."""
    batches = list(batches)
    reports = schedule(forward_step_func=forward_step_func, data_iterator=iter(batches), model_chunks=chunks,
                       num_microbatches=len(batches), forward_only=True)
    yield from zip(batches, reports)


def _progress_bar(total: int, show: bool):
    """A tqdm bar on stderr over ``total`` forwards (``disable`` unless ``show``)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="forwards", desc="validation", disable=not show, mininterval=1.0)


def _counted(forward_step_func: Callable, bar) -> Callable:
    """``forward_step_func`` that advances ``bar`` once per call (the schedule calls it once per micro-batch
    and model chunk)."""
    def step(data_iterator, model):
        output = forward_step_func(data_iterator, model)
        bar.update(1)
        return output

    return step


def evaluate(model, batches: Iterable[dict], *, forward_step_func: Callable,
             group: Optional[dist.ProcessGroup], num_packs: int = 0,
             schedule: Callable, pp_group: Optional[dist.ProcessGroup] = None, source_names: Sequence[str] = (),
             progress: bool = False) -> EvalResult:
    """Token-weighted validation loss of ``batches`` (this rank's packs), reduced over ``group`` (DP x CP).
    ``model`` is this rank's model chunk, or the list of its chunks (virtual pipeline stages).

    With ``source_names`` (the dataset's data.sources names, the same list on every rank) each
    batch's report must carry ``"source loss"`` (``forward_step`` adds it for batches with
    ``token_source``), and the result holds each source's loss and target count.

    ``schedule`` runs the forwards: the training step's (``schedule.forward_backward`` with the run's
    state; megatron-core's, ``forward_only=True``), called with ``forward_step_func``, ``data_iterator``,
    ``model_chunks``, ``num_microbatches`` and ``forward_only``; it returns the reports of the rank holding
    the loss. With ``pp_group`` (more than one stage) the last stage's sums, reduced over ``group``, are
    broadcast to every stage. ``progress``: a bar on stderr counting this rank's forwards (one rank shows it).
    """
    from megatron_pack.training.breakdown import source_metrics

    names = list(source_names)
    # [loss sum, target count, per-source loss sums..., per-source target counts...]
    sums = torch.zeros(2 + 2 * len(names), dtype=torch.float64)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    was_training = chunks[0].training
    for chunk in chunks:
        chunk.eval()
    batches = list(batches)
    bar = _progress_bar(len(batches) * len(chunks), progress)
    try:
        with torch.no_grad():
            for batch, report in _reports(chunks, _counted(forward_step_func, bar), batches, schedule):
                sums[:2] += report["lm loss"].double().cpu()
                if names:
                    if "source loss" not in report:
                        raise ValueError(f"validation batch with sample_ids {batch.get('sample_ids')} has no "
                                         f"token_source, but the dataset names sources {names}; collate it with "
                                         "make_collate_fn(dataset.metadata).")
                    sums[2:] += report["source loss"].double().cpu()
    finally:
        bar.close()
        for chunk in chunks:
            chunk.train(was_training)
    if group is not None:
        all_reduce(sums, group=group)
    if pp_group is not None and group_size(pp_group) > 1:  # the last stage's sums, on every stage
        broadcast(sums, src=group_ranks(pp_group)[-1], group=pp_group)
    values = sums.tolist()
    loss = values[0] / values[1] if values[1] > 0 else 0.0
    source_loss, _ = source_metrics(values[2:], names)
    counts = {name: int(round(c)) for name, c in zip(names, values[2 + len(names):])}
    return EvalResult(loss=loss, target_tokens=int(round(values[1])), num_packs=num_packs, source_loss=source_loss,
                      source_target_tokens=counts)
