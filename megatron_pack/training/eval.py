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
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

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


def open_validation(cfg, train_dataset=None):
    """The validation ``PackedSFTDataset`` of the training plan, or None when it has none.

    The training plan's manifest says which (``data.validation``: the plan prepared from that file, recorded
    with its folder under ``<data.dataset_dir>/validation``; ``data.validation_fraction``: the plan's own
    ``validation`` sub-plan), so train needs neither key repeated. It is checked against the training store's
    tokenizer identity (chat template included), never against a tokenizer rebuilt from the command line.
    ``train_dataset`` is opened from ``cfg`` when not given; one without a manifest (online, in-batch) falls
    back to ``cfg``'s keys. Raises ``DataError`` naming the prepare command when it is missing.
    """
    from megatron_pack.data.batches.dataset import PackedSFTDataset

    train_dataset = train_dataset if train_dataset is not None else PackedSFTDataset.from_config(cfg)
    manifest = getattr(train_dataset, "metadata", {}).get("manifest")
    if manifest is None:
        return _validation_from_config(cfg, train_dataset)
    identity = train_dataset.store_metadata["tokenizer"]
    if manifest.get("data.validation"):
        return _validation_file(train_dataset, manifest["data.validation"], identity)
    if manifest.get("data.validation_fraction"):
        return _held_out(train_dataset, identity)
    return None


def _held_out(train_dataset, identity):
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.formats.sources import DataError
    from megatron_pack.data.store.metadata import VALIDATION_DIRNAME

    plan_dir = Path(train_dataset.plan_dir) / VALIDATION_DIRNAME
    if not (plan_dir / "metadata.json").is_file():
        raise DataError(f"the packing plan {train_dataset.plan_dir} records a data.validation_fraction but has no "
                        f"held-out validation plan {plan_dir}; delete {train_dataset.plan_dir} and re-run "
                        "`megatron-pack prepare` with the same config.")
    dataset = PackedSFTDataset(train_dataset.dataset_dir, plan_dir, expected_tokenizer=identity)
    if "mixture" in dataset.metadata:  # written before held-out samples were packed each once
        raise DataError(f"the validation plan {plan_dir} was written by an older prepare that resampled the held-out "
                        "samples to the data.sources shares (some never evaluated, others repeated); delete "
                        f"{train_dataset.plan_dir} and re-run `megatron-pack prepare` with the same config.")
    return dataset


def _validation_file(train_dataset, recorded: dict, identity):
    """The plan ``prepare data.validation=FILE`` wrote, checked to hold that file's records."""
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.formats.sources import DataError

    plan_dir = Path(train_dataset.dataset_dir) / recorded.get("plan", "<missing>")
    redo = (f"re-run `megatron-pack prepare data.dataset_dir={train_dataset.dataset_dir} "
            f"data.validation={recorded['input']} ...` with the training plan's settings")
    if not (plan_dir / "metadata.json").is_file():
        raise DataError(f"the training plan {train_dataset.plan_dir} was prepared with data.validation="
                        f"{recorded['input']}, but its validation plan {plan_dir} is missing; {redo}.")
    dataset = PackedSFTDataset(plan_dir.parent.parent, plan_dir, expected_tokenizer=identity)
    files = [{"name": Path(f["path"]).name, "sha256": f.get("sha256")}
             for f in dataset.store_metadata["sources"].get("files", [])]
    if sorted(files, key=str) != sorted(recorded["files"], key=str):
        raise DataError(f"the validation store {plan_dir.parent.parent} holds other records than data.validation="
                        f"{recorded['input']} had when the training plan {train_dataset.plan_dir.name} was prepared "
                        f"(another prepare replaced it); {redo}.")
    return dataset


def _validation_from_config(cfg, train_dataset):
    """Online and in-batch runs (no training plan): the validation set the config names."""
    from megatron_pack.data.batches.dataset import PackedSFTDataset

    if cfg.data.validation is not None:
        from megatron_pack.data.prepare import validation_config

        return PackedSFTDataset.from_config(validation_config(cfg))
    if not cfg.data.validation_fraction:
        return None
    from megatron_pack.data.batches.dataset import _expected_tokenizer

    return _held_out(train_dataset, _expected_tokenizer(cfg))


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

    @property
    def source_names(self) -> list[str]:
        """The dataset's data.sources names (the same on every rank; empty for a single input)."""
        return list(getattr(self.dataset, "source_names", []))

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


def _forward_report(model: torch.nn.Module, forward_step_func: Callable, batch: dict) -> dict:
    output, loss_fn = forward_step_func(iter([batch]), model)
    _, _, report = loss_fn(output)
    return report


def evaluate(model: torch.nn.Module, batches: Iterable[dict], *, forward_step_func: Callable,
             group: Optional[dist.ProcessGroup], num_packs: int = 0,
             source_names: Sequence[str] = ()) -> EvalResult:
    """Token-weighted validation loss of ``batches`` (this rank's packs), reduced over ``group`` (DP x CP).

    With ``source_names`` (the dataset's data.sources names, the same list on every rank) each
    batch's report must carry ``"source loss"`` (``forward_step`` adds it for batches with
    ``token_source``), and the result holds each source's loss and target count.
    """
    from megatron_pack.training.breakdown import source_metrics

    names = list(source_names)
    # [loss sum, target count, per-source loss sums..., per-source target counts...]
    sums = torch.zeros(2 + 2 * len(names), dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                report = _forward_report(model, forward_step_func, batch)
                sums[:2] += report["lm loss"].double().cpu()
                if names:
                    if "source loss" not in report:
                        raise ValueError(f"validation batch with sample_ids {batch.get('sample_ids')} has no "
                                         f"token_source, but the dataset names sources {names}; collate it with "
                                         "make_collate_fn(dataset.metadata).")
                    sums[2:] += report["source loss"].double().cpu()
    finally:
        model.train(was_training)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    values = sums.tolist()
    loss = values[0] / values[1] if values[1] > 0 else 0.0
    source_loss, _ = source_metrics(values[2:], names)
    counts = {name: int(round(c)) for name, c in zip(names, values[2 + len(names):])}
    return EvalResult(loss=loss, target_tokens=int(round(values[1])), num_packs=num_packs, source_loss=source_loss,
                      source_target_tokens=counts)
