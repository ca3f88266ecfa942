"""The one protocol of the loaders the training loop reads, and what a step and a loader tell it.

Four loaders play one role: ``StepLoader`` (offline packs and in-batch micro-batches: every step
planned, steps.py), ``OnlineLoader`` (packs made at run time, online.py), the validation loader
(``training/eval.py``) and ``BatchList`` (fixed batches, for tests and benchmarks). The loop uses
them only through ``BatchLoader``, never by probing for attributes::

    loader = build_loader(cfg, dataset, dp_rank=0, dp_size=2)
    batches = iter(loader)
    info = loader.begin_step()                 # the next step's plan: this rank's micro-batches
    step = [next(batches) for _ in range(info.num_microbatches)]
    state = loader.state_dict()                # resumes at the next step (plain values, checkpoint-safe)
    loader.epoch, loader.packs_per_epoch       # 0.25, 8: a quarter into the first epoch of 8 packs

Like torchtitan's ``Stateful`` components, each loader saves and restores its own position;
``state_dict()`` after ``begin_step()`` names the step after the one begun, whatever the DataLoader
workers have prefetched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Protocol, Sequence


@dataclass(frozen=True)
class StepInfo:
    """What the loop needs to know about the step it begins."""

    num_microbatches: Optional[int] = None
    """Batches this DP rank trains in the step; None: the config's fixed count,
    ``train.global_batch_size / (dp * train.micro_batch_size)`` (a ``BatchList`` plans nothing)."""
    tokens: Optional[int] = None
    """Budget tokens of the whole step (global), when a planner knows them."""
    imbalance_before: Optional[float] = None
    """Max/mean DP-rank cost of the round-robin deal (reported with a token budget or balancing)."""
    imbalance_after: Optional[float] = None
    """Max/mean DP-rank cost of the deal used."""


@dataclass(frozen=True)
class LoaderInfo:
    """What the metrics need of a loader's data; the same on every rank."""

    num_buckets: int = 0
    """Length buckets of the plan (packing.buckets; 0: no per-bucket metrics)."""
    source_names: tuple[str, ...] = ()
    """data.sources names (empty: no per-source metrics)."""
    fingerprint: Optional[str] = None
    """The plan's fingerprint, which a resume compares (None: no plan)."""
    tokenizer: Optional[str] = None
    """The tokenizer folder (or ``byte``) the plan's data was tokenized with, from its manifest (None: no manifest)."""
    chat_template: Optional[str] = None
    """The text of the ``data.chat_template`` the data was rendered with (None: the tokenizer's own), which the
    run's ``hf_source`` copy, and so its export, carries."""


def loader_info(metadata: Mapping[str, Any]) -> LoaderInfo:
    """``LoaderInfo`` of a dataset from its metadata (``buckets.per_bucket``, ``source_names``, ``fingerprint``,
    the manifest's ``data.tokenizer`` and ``data.chat_template``)."""
    manifest = metadata.get("manifest") or {}
    return LoaderInfo(num_buckets=len(metadata.get("buckets", {}).get("per_bucket", [])),
                      source_names=tuple(metadata.get("source_names", [])), fingerprint=metadata.get("fingerprint"),
                      tokenizer=(manifest.get("data.tokenizer") or {}).get("path"),
                      chat_template=(manifest.get("data.chat_template") or {}).get("text"))


class BatchLoader(Protocol):
    """What the training loop needs of a loader (module docstring)."""

    info: LoaderInfo

    def __iter__(self) -> Iterator[dict]:
        """THD batches in the order the steps take them (call before the first ``begin_step``)."""

    def begin_step(self) -> StepInfo:
        """Plan the next step; afterwards ``state_dict()`` resumes after it."""

    def state_dict(self) -> dict:
        """The resume point and what it depends on, as plain values."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state`` (before ``iter``); refuses a state this loader cannot continue, naming why."""

    @property
    def epoch(self) -> float:
        """Epochs trained: whole epochs plus the share of the current one (whole epochs online)."""

    @property
    def packs_per_epoch(self) -> Optional[int]:
        """Packs one epoch trains over all DP ranks; None online (packs are made at run time)."""

    def num_steps(self, num_epochs: int) -> Optional[int]:
        """Optimizer steps ``num_epochs`` epochs take (``train.num_epochs``); None where unknown up front."""


@dataclass
class BatchList:
    """Fixed THD batches, one pass, resuming at the next batch: the ``BatchLoader`` of tests and benchmarks.

    It plans nothing: each step takes the config's fixed count of batches (``StepInfo()``)."""

    batches: Sequence[dict]
    next: int = 0
    """Batches handed out so far (the resume point)."""
    info: LoaderInfo = field(default_factory=LoaderInfo)

    def __iter__(self) -> Iterator[dict]:
        while self.next < len(self.batches):
            self.next += 1
            yield self.batches[self.next - 1]

    def begin_step(self) -> StepInfo:
        return StepInfo()

    def state_dict(self) -> dict:
        return {"kind": "batches", "next": self.next}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "batches":
            raise ValueError(f"loader state {dict(state)!r} was not written by a BatchList.")
        self.next = int(state["next"])

    @property
    def epoch(self) -> float:
        return self.next / len(self.batches) if len(self.batches) else 0.0

    @property
    def packs_per_epoch(self) -> Optional[int]:
        return len(self.batches)

    def num_steps(self, num_epochs: int) -> Optional[int]:
        return None  # the count per step is the trainer's: train.train_iters, not epochs
