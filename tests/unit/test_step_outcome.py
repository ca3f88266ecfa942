"""The step outcome (training/outcome.py): hand-computed sums of one rank's micro-batches, and the
shape of what the pipeline broadcast carries. The multi-process broadcast is in
tests/functional/test_step_outcome_world.py."""

import dataclasses
import math

import pytest
import torch

from megatron_pack.training.metrics import StepCounts
from megatron_pack.training.outcome import StepOutcome, local_counts, reduce_outcome
from megatron_pack.training.schedule import PackInfo


def _report(loss_sum, count, **extra):
    return {"lm loss": torch.tensor([loss_sum, count]), **{k: torch.tensor(v) for k, v in extra.items()}}


PACKS = [PackInfo(sample_ids=[4, 9], real_tokens=11, slots=16, bucket=1), PackInfo(sample_ids=[2], real_tokens=5, slots=8)]

# (id, reports, owns packs, expected (loss sum, targets, real tokens, slots, samples), local targets, extra reports)
CASES = [
    ("two-packs-owner", [_report(3.5, 7.0), _report(1.0, 2.0)], True, (4.5, 9.0, 16, 24, 3), 9, {}),
    ("two-packs-cp-rank-1", [_report(3.5, 7.0), _report(1.0, 2.0)], False, (4.5, 9.0, 0, 0, 0), 9, {}),
    ("extra-report-summed-by-name", [_report(2.0, 4.0, aux=[0.25, 1.0]), _report(1.0, 1.0, aux=[0.5, 1.0])], True,
     (3.0, 5.0, 16, 24, 3), 5, {"aux": [0.75, 2.0]}),
    ("all-masked", [_report(0.0, 0.0), _report(0.0, 0.0)], True, (0.0, 0.0, 16, 24, 3), 0, {}),
]


@pytest.mark.parametrize("reports,owns,want,local,extra", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_reduce_outcome_sums_one_ranks_micro_batches(reports, owns, want, local, extra):
    outcome = reduce_outcome(reports, PACKS, num_buckets=2, num_sources=0, owns_packs=owns, group=None)
    c = outcome.counts
    assert (c.loss_sum, c.target_tokens, c.real_tokens, c.slots, c.samples) == want
    assert c.bucket_real_tokens == ([5, 11] if owns else [0, 0])
    assert outcome.local_target_tokens == local and outcome.reports == extra
    assert outcome.finite and outcome.received
    assert int(outcome.num_tokens(torch.device("cpu"))) == local


def test_a_non_finite_loss_sum_makes_the_outcome_not_finite():
    outcome = reduce_outcome([_report(float("nan"), 3.0), _report(1.0, 1.0)], PACKS, num_buckets=0,
                             num_sources=0, owns_packs=True, group=None)
    assert not outcome.finite and math.isnan(outcome.counts.loss_sum)


def test_local_counts_carry_the_per_source_loss():
    reports = [{**_report(2.0, 4.0), "source loss": torch.tensor([1.5, 0.5, 3.0, 1.0])}]
    counts, local, extra = local_counts(reports, PACKS[:1], num_buckets=0, num_sources=2, owns_packs=True)
    assert counts.source_loss == [1.5, 0.5, 3.0, 1.0] and local == 4 and extra == {}


def test_the_broadcast_payload_round_trips_and_a_placeholder_is_marked():
    outcome = StepOutcome(counts=StepCounts(1.5, 3.0, 7, 8, 2, [3, 4], [0.5, 1.0]), local_target_tokens=3,
                          finite=True, reports={"aux": [0.25]})
    assert StepOutcome.from_dict(dataclasses.asdict(outcome)) == outcome
    pending = StepOutcome.pending()
    assert not pending.received and StepOutcome.from_dict(dataclasses.asdict(pending)).received


def test_a_single_stage_pipeline_broadcasts_nothing():
    """At PP=1 every rank holds the loss: the outcome is returned as is, no collective entered."""
    from types import SimpleNamespace

    outcome = StepOutcome(counts=StepCounts(), local_target_tokens=0, finite=True)
    state = SimpleNamespace(pp_size=1, is_last_stage=True, pp_group=None)
    assert outcome.broadcast_from_last_stage(state) is outcome
