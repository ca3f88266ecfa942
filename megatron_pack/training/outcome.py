"""One step's outcome, reached on the ranks that hold the loss and then known to every rank.

The loss exists only where the model's last layer runs: on the last pipeline stage (every rank at
PP=1). There each rank sums its micro-batches' reports and the packs it read, and the DP x CP group
sums those in ONE float64 all-reduce (:func:`reduce_outcome`). The result, a :class:`StepOutcome`,
is then broadcast from the last stage to the rest of its pipeline group
(:meth:`StepOutcome.broadcast_from_last_stage`; nothing to send at PP=1), so every rank takes the
same branch on the non-finite check and gives ``finalize_model_grads`` the same token count.

Example (PP=2, DP=1, two micro-batches of 5 and 3 target tokens): stage 1 reduces
``counts.target_tokens == 8`` and ``local_target_tokens == 8``; stage 0 holds no report, enters the
broadcast with :meth:`StepOutcome.pending` and leaves it with the same outcome.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_pack.parallel.comm import all_gather_object, all_reduce
from megatron_pack.parallel.groups import ParallelState
from megatron_pack.training.metrics import StepCounts

COUNTED_REPORTS = ("lm loss", "source loss")
"""Report keys the step counts itself (``StepCounts``); any other tensor in a report is summed under
its name into ``StepOutcome.reports`` (e.g. a mixture-of-experts auxiliary loss)."""


@dataclass
class StepOutcome:
    """What one step produced, the same on every rank once broadcast (every check branches on it)."""

    counts: StepCounts
    """Global counts: loss sum, target and real tokens, slots, samples, breakdowns, summed over DP x CP."""
    local_target_tokens: int
    """Target tokens of this rank's DP x CP shard (its pipeline's last stage), for ``finalize_model_grads``."""
    finite: bool
    """The global loss sum is finite."""
    reports: dict[str, list[float]] = field(default_factory=dict)
    """Every other report of the loss function, by name: summed over micro-batches and DP x CP."""
    received: bool = True
    """False on a placeholder (:meth:`pending`) that has not been through the broadcast yet."""

    @classmethod
    def pending(cls) -> "StepOutcome":
        """The placeholder a rank without the loss enters the broadcast with."""
        return cls(counts=StepCounts(), local_target_tokens=0, finite=True, received=False)

    def broadcast_from_last_stage(self, state: ParallelState,
                                  stage_reports: Optional[dict[str, list[float]]] = None) -> "StepOutcome":
        """The last pipeline stage's outcome on every rank of ``state.pp_group``, its ``reports`` joined by every
        other stage's ``stage_reports`` (reduced over that stage's DP x CP; collective: every rank of the group calls
        it; a single-stage pipeline returns ``self``)."""
        if state.pp_size == 1:
            return self
        if state.is_last_stage and not self.received:
            raise AssertionError("the last pipeline stage must broadcast a reduced outcome, not a placeholder")
        parts = all_gather_object((asdict(self) if state.is_last_stage else None, stage_reports or {}),
                                  group=state.pp_group)
        outcome = StepOutcome.from_dict(parts[-1][0])
        for _, named in parts[:-1]:
            outcome.reports.update(named)
        return outcome

    @classmethod
    def from_dict(cls, d: dict) -> "StepOutcome":
        """The inverse of ``dataclasses.asdict`` (what the broadcast carries)."""
        return cls(counts=StepCounts(**d["counts"]), local_target_tokens=int(d["local_target_tokens"]),
                   finite=bool(d["finite"]), reports={k: list(v) for k, v in d["reports"].items()})

    def num_tokens(self, device: torch.device) -> torch.Tensor:
        """``local_target_tokens`` as the int32 tensor ``finalize_model_grads(num_tokens=...)`` sums over DP x CP."""
        return torch.tensor(self.local_target_tokens, dtype=torch.int32, device=device)


def _as_floats(value) -> list[float]:
    return (value.detach().double().cpu().reshape(-1).tolist() if torch.is_tensor(value)
            else [float(v) for v in (value if isinstance(value, (list, tuple)) else [value])])


def local_counts(reports: Sequence[dict], packs: Sequence, *, num_buckets: int, num_sources: int,
                 owns_packs: bool, sum_sq: Optional[Sequence[int]] = None
                 ) -> tuple[StepCounts, int, dict[str, list[float]]]:
    """This rank's counts over its micro-batches (``reports`` and ``packs``: one per micro-batch):
    the ``StepCounts``, the target tokens, and the other reports summed by name. ``owns_packs``:
    this rank counts the pack-level numbers (CP rank 0; the other CP ranks see slices of the same packs).
    ``sum_sq``: each pack's sum of squared sub-sequence lengths (``flops.sum_sq_seqlens``), for the FLOPs."""
    counts = StepCounts(bucket_real_tokens=[0] * num_buckets, source_loss=[0.0] * (2 * num_sources))
    local_tokens, extra = 0, {}
    sum_sq = list(sum_sq) if sum_sq is not None else [0] * len(packs)
    for report, pack, pack_sum_sq in zip(reports, packs, sum_sq):
        loss_sum, num_tokens = _as_floats(report["lm loss"])
        source_loss = _as_floats(report["source loss"]) if "source loss" in report else None
        counts.add_pack(loss_sum=loss_sum, target_tokens=num_tokens, real_tokens=pack.real_tokens,
                        slots=pack.slots, samples=len(pack.sample_ids), owns_pack=owns_packs, bucket=pack.bucket,
                        source_loss=source_loss, sum_sq_seqlens=pack_sum_sq)
        local_tokens += int(round(num_tokens))
        for name in sorted(set(report) - set(COUNTED_REPORTS)):
            values = _as_floats(report[name])
            extra[name] = [a + b for a, b in zip(extra[name], values, strict=True)] if name in extra else values
    return counts, local_tokens, extra


def reduce_outcome(reports: Sequence[dict], packs: Sequence, *, num_buckets: int, num_sources: int,
                   owns_packs: bool, group: Optional[dist.ProcessGroup],
                   sum_sq: Optional[Sequence[int]] = None,
                   stage_reports: Optional[dict[str, list[float]]] = None) -> StepOutcome:
    """The step's outcome from this rank's micro-batches, summed over ``group`` (DP x CP) in one float64
    all-reduce. Every rank of ``group`` calls it with reports of the same keys and sizes (the same
    loss function, and at least one micro-batch per rank, which every step planner guarantees), so
    every rank enters the same collective whatever its packs hold: only padding or masked tokens.
    ``stage_reports`` (``step_outcome``) join the reports in the same all-reduce."""
    counts, local_tokens, extra = local_counts(reports, packs, num_buckets=num_buckets, num_sources=num_sources,
                                               owns_packs=owns_packs, sum_sq=sum_sq)
    extra.update(stage_reports or {})
    reduced = _reduce_named({_COUNTS: counts.to_vector(), **extra}, group)
    total = StepCounts.from_vector(reduced.pop(_COUNTS), num_buckets)
    return StepOutcome(counts=total, local_target_tokens=local_tokens, finite=math.isfinite(total.loss_sum),
                       reports=reduced)


def step_outcome(reports: Sequence[dict], packs: Sequence, state: ParallelState, *, num_buckets: int,
                 num_sources: int, sum_sq: Optional[Sequence[int]] = None,
                 stage_reports: Optional[dict[str, list[float]]] = None) -> StepOutcome:
    """The outcome every rank agrees on: reduced over DP x CP on the last pipeline stage, broadcast to
    the other stages (collective over ``state.dp_cp_group`` there, then over ``state.pp_group``).

    ``stage_reports``: numbers of this stage's own layers (a MoE model's step records, ``model.moe``), by name,
    the same names on every rank of the stage. Each stage sums them over its DP x CP group (the last stage in its
    one reduction) and every stage's join ``reports`` on every rank."""
    outcome = StepOutcome.pending()
    stage_reports = dict(stage_reports or {})
    if state.is_last_stage:
        outcome = reduce_outcome(reports, packs, num_buckets=num_buckets, num_sources=num_sources,
                                 owns_packs=state.cp_rank == 0, group=state.dp_cp_group, sum_sq=sum_sq,
                                 stage_reports=stage_reports)
    elif stage_reports:
        stage_reports = _reduce_named(stage_reports, state.dp_cp_group)
    return outcome.broadcast_from_last_stage(state, {} if state.is_last_stage else stage_reports)


_COUNTS = " counts"
"""The name of the ``StepCounts`` vector among the reduced reports (no report name starts with a space)."""


def _reduce_named(named: dict[str, list[float]], group) -> dict[str, list[float]]:
    """``named`` summed over ``group`` in one float64 all-reduce (every rank gives the same names and sizes; a CPU
    vector, which ``all_reduce`` moves to an NCCL group's device and back)."""
    names = sorted(named)
    vec = torch.tensor([v for name in names for v in named[name]], dtype=torch.float64)
    if group is not None:
        all_reduce(vec, group=group)
    values, out, offset = vec.tolist(), {}, 0
    for name in names:
        out[name], offset = values[offset:offset + len(named[name])], offset + len(named[name])
    return out


def check_step_finite(outcome: StepOutcome, *, step: int, model_chunks: Sequence[torch.nn.Module],
                      reports: Sequence[dict], batches: Sequence[dict], state: ParallelState) -> None:
    """Raise on every rank together when the step's global loss is not finite: non-finite weights
    named as weights (a collective count over the world), otherwise the pack whose loss is not
    finite named as data by the rank that holds it, and by the others as 'named by another rank'."""
    if outcome.finite:
        return
    from megatron_pack.training.finite import check_weights
    from megatron_pack.training.step import check_finite

    where = f"step {step}, rank {state.rank}"
    check_weights(list(model_chunks), where=where, device=state.device,
                  source=f"the model after step {step - 1}" if step > 1 else "the model the run started from",
                  fix=("the optimizer step before diverged: resume from the last checkpoint with a lower train.lr "
                       "(or a train.clip_grad)") if step > 1 else
                      ("no step ran yet: check model.pretrained's safetensors or the checkpoint this run started "
                       "from (megatron-pack train --check names the tensor)"))
    for report, batch in zip(reports, batches):
        try:
            check_finite(report["lm loss"][0], batch)
        except FloatingPointError as exc:
            raise FloatingPointError(f"{where}: data (the weights are finite): {exc}") from None
    raise FloatingPointError(f"{where}: data (the weights are finite): the global lm loss is not finite; the "
                             "pack that produced it is named in the error of another rank.")
