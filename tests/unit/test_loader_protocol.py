"""One loader protocol (issue 23 item 1): every loader kind plays ``protocol.BatchLoader``, the fixed
global batch is a rule of the step planner (dealing exactly as ``PackSampler`` did), the epoch order
carries the buckets for every rule, and ``train.num_epochs`` is checked before process groups start."""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pack.config import ConfigError, load_config, validate
from megatron_pack.data.batches.protocol import BatchList, StepInfo
from megatron_pack.data.batches.sampler import PackSampler
from megatron_pack.data.batches.steps import StepLoader, StepPlanner, StepRule

ROOT = Path(__file__).resolve().parents[2]


# ----- the fixed global batch is one rule of the planner -----------------------------------------

@settings(max_examples=80, deadline=None)
@given(num_packs=st.integers(1, 40), dp=st.integers(1, 4), per_rank=st.integers(1, 3), extra=st.integers(0, 3),
       seed=st.integers(0, 3), shuffle=st.booleans(), bucketed=st.booleans())
def test_the_fixed_batch_rule_deals_as_pack_sampler(num_packs, dp, per_rank, extra, seed, shuffle, bucketed):
    """Same packs on the same ranks across epoch boundaries, and (a step of a multiple of dp packs, as
    validate() asks) the same packs per step and the same resume point."""
    if num_packs < dp:
        return
    gbs = dp * per_rank + extra % dp
    groups = np.random.default_rng(seed).integers(0, 3, num_packs) if bucketed else None
    samplers = [PackSampler(num_packs, dp_rank=r, dp_size=dp, seed=seed, shuffle=shuffle, groups=groups)
                for r in range(dp)]
    planner = StepPlanner(None, samplers[0].order, StepRule(dp_size=dp, global_batch_size=gbs))
    num_steps = 3 * (num_packs // dp) * dp // gbs + 2  # about three epochs
    plans = list(itertools.islice(planner.steps(0, 0), num_steps))
    for r, sampler in enumerate(samplers):
        mine = [int(i) for p in plans for i in p.per_rank[r]]
        assert mine == list(itertools.islice(iter(sampler), len(mine)))
    assert planner.num_steps(3) == 3 * (num_packs - num_packs % dp) // gbs
    for plan in plans:
        assert plan.imbalance_before is None and plan.tokens is None  # nothing to report without a budget or balancing
        if gbs % dp == 0:  # the resume point after each step is the sampler's after as many packs
            assert [len(p) for p in plan.per_rank] == [per_rank] * dp
            samplers[0].advance(per_rank)
            assert plan.end == (samplers[0].epoch, samplers[0].consumed)


def test_an_older_fixed_batch_checkpoint_resumes_at_its_next_pack():
    """A checkpoint written by the PackSampler loader of earlier versions resumes with the same packs."""
    dataset = [[{"input_ids": np.arange(4) + i, "loss_mask": np.ones(4), "sample_id": i}] for i in range(9)]
    sampler = PackSampler(9, dp_rank=0, dp_size=1, seed=4)
    expected = list(itertools.islice(iter(sampler), 15))
    sampler.advance(11)  # into the second epoch
    loader = StepLoader(dataset, lambda samples: samples[0]["sample_id"],
                        StepPlanner(None, sampler.order, StepRule(dp_size=1, global_batch_size=1)), dp_rank=0, seed=4)
    loader.load_state_dict(sampler.state_dict())
    batches = iter(loader)
    got = []
    for _ in range(4):
        assert loader.begin_step().num_microbatches == 1
        got.append(next(batches))
    assert got == expected[11:] and loader.epoch == pytest.approx(1 + 6 / 9)  # 11 + 4 packs: 6 into epoch 1


# ----- a prepared, bucketed dataset -------------------------------------------------------------------

@pytest.fixture(scope="module")
def bucketed(tmp_path_factory):
    from megatron_pack.data.prepare import prepare

    overrides = ["data.synthetic_num_samples=240", f"data.dataset_dir={tmp_path_factory.mktemp('protocol') / 'ds'}",
                 "packing.packed_sequence_size=256", "model.seq_length=256", "data.tokenize_workers=1",
                 "packing.buckets=auto", "train.global_batch_size=4"]
    prepare(load_config(overrides), progress=False)
    return overrides


def _open(overrides, *extra):
    from megatron_pack.data.batches.opening import open_dataset

    cfg = load_config(overrides + list(extra))
    return cfg, open_dataset(cfg)


STEP_RULES = [("fixed", ()), ("fixed-balanced", ("packing.balance=dp",)),
              ("budget", ("train.global_batch_tokens=300",)),
              ("budget-balanced", ("train.global_batch_tokens=300", "packing.balance=dp"))]


@pytest.mark.parametrize("extra", [r[1] for r in STEP_RULES], ids=[r[0] for r in STEP_RULES])
def test_sequential_bucket_order_holds_for_every_step_rule_and_deal(bucketed, extra):
    """issue 23: packing.bucket_order=sequential was ignored with a token budget or packing.balance=dp."""
    from megatron_pack.data.batches.loader import build_loader

    cfg, dataset = _open(bucketed, "packing.bucket_order=sequential", *extra)
    loaders = [build_loader(cfg, dataset, dp_rank=r, dp_size=2) for r in range(2)]
    buckets, per_rank = [], [iter(loader) for loader in loaders]
    while sum(map(len, buckets)) < 0.8 * len(dataset):  # most of epoch 0
        steps = [loader.begin_step() for loader in loaders]
        step = [int(next(per_rank[r])["bucket"]) for r, info in enumerate(steps) for _ in range(info.num_microbatches)]
        buckets.append(sorted(step))
    flat = [b for step in buckets for b in step]
    assert len(set(flat)) >= 3, "the plan has too few buckets to test the order"  # guard
    assert all(max(a) <= min(b) for a, b in zip(buckets, buckets[1:])), buckets  # bucket after bucket, shortest first


def test_sequential_bucket_order_is_refused_where_there_are_no_buckets():
    """Online and in-batch packs are made at run time: a bucket order there would do nothing."""
    for mode in ("online", "in_batch"):
        with pytest.raises(ConfigError, match=f"packing.buckets .* packing.mode={mode}"):
            validate(_mode_cfg(mode))


def _mode_cfg(mode):
    from megatron_pack.config import Config, PackingConfig, TrainConfig

    return Config(packing=PackingConfig(mode=mode, buckets="auto", bucket_order="sequential"),
                  train=TrainConfig(micro_batch_size=4 if mode == "in_batch" else 1))


# ----- train.num_epochs with every loader kind ---------------------------------------------------------

def test_num_epochs_with_online_packing_is_refused_by_validate():
    from megatron_pack.config import Config, PackingConfig, TrainConfig

    cfg = Config(packing=PackingConfig(mode="online"), train=TrainConfig(train_iters=None, num_epochs=2))
    with pytest.raises(ConfigError, match=r"train.num_epochs \(2\) .* packing.mode=online .* set train.train_iters"):
        validate(cfg)


@pytest.mark.parametrize("extra", [r[1] for r in STEP_RULES], ids=[r[0] for r in STEP_RULES])
def test_num_epochs_counts_the_planned_steps_of_every_rule(bucketed, extra):
    """issue 23: with a budget or balancing the loader had no sampler and build_trainer raised ValueError."""
    from megatron_pack.data.batches.loader import build_loader
    from megatron_pack.training.resume import check_resume, planned_train_iters, resolve_train_iters

    cfg, dataset = _open(bucketed, "train.train_iters=null", "train.num_epochs=2", *extra)
    assert check_resume(cfg, 2, dataset) is None  # counted before any process group, here without error
    loader = build_loader(cfg, dataset, dp_rank=0, dp_size=2)
    iters = resolve_train_iters(cfg, loader)
    assert iters == planned_train_iters(cfg, dataset, 2) > 2
    # the steps that end by the start of epoch 2 (a budget step never spans epochs; a fixed one may)
    ends = [plan.end for plan in itertools.islice(loader.planner.steps(0, 0), 3 * iters)]
    assert iters == sum(end <= (2, 0) for end in ends) and ends[-1] > (2, 0)


def test_num_epochs_below_one_step_is_refused_before_process_groups(bucketed):
    from megatron_pack.training.resume import check_resume

    cfg, dataset = _open(bucketed, "train.train_iters=null", "train.num_epochs=1", "train.global_batch_size=512")
    with pytest.raises(ConfigError, match=r"train.num_epochs \(1\) over \d+ packs per epoch is less than one global"):
        check_resume(cfg, 1, dataset)


@pytest.mark.slow
def test_build_trainer_with_num_epochs_and_a_budget(bucketed, tmp_path):
    """The user's path: train.num_epochs with a token budget builds the trainer and trains its steps."""
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.loop import build_loader, build_trainer

    enable_cpu_compat_without_cuda()
    cfg, dataset = _open(bucketed, "train.train_iters=null", "train.num_epochs=1", "train.global_batch_tokens=1500",
                         f"train.output_dir={tmp_path}", "checkpoint.enabled=false", "logging.tensorboard=false")
    state = initialize_parallel(cfg)
    try:
        trainer = build_trainer(cfg, state, build_loader(cfg, state, dataset))
        assert trainer.train_iters == trainer.loader.num_steps(1) >= 2
        metrics = trainer.train_step()
        assert metrics.target_tokens >= 1500 and 0 < metrics.epoch < 1
    finally:
        destroy_parallel(destroy_process_group=True)


# ----- every loader kind plays the protocol -----------------------------------------------------------

def _loaders(overrides):
    from megatron_pack.data.batches.loader import build_loader, collate_from_config
    from megatron_pack.training.eval import ValidationLoader

    cfg, dataset = _open(overrides)
    budget_cfg, _ = _open(overrides, "train.global_batch_tokens=300", "packing.balance=dp")
    online_cfg = dataclasses.replace(cfg, packing=dataclasses.replace(cfg.packing, mode="online", buckets=None))
    from megatron_pack.data.batches.opening import open_dataset

    return {"fixed": build_loader(cfg, dataset, dp_rank=0, dp_size=1),
            "budget": build_loader(budget_cfg, dataset, dp_rank=0, dp_size=1),
            "online": build_loader(online_cfg, open_dataset(online_cfg), dp_rank=0, dp_size=1),
            "validation": ValidationLoader(dataset, collate_from_config(cfg, dataset.metadata), num_packs=6,
                                           dp_rank=0, dp_size=1),
            "list": BatchList([{"n": i} for i in range(8)])}


def test_every_loader_kind_plays_the_protocol(bucketed):
    loaders = _loaders(bucketed)
    for name, loader in loaders.items():
        batches = iter(loader)
        info = loader.begin_step()
        assert isinstance(info, StepInfo), name
        for _ in range(info.num_microbatches or 4):
            assert isinstance(next(batches), dict), name
        state = loader.state_dict()
        assert isinstance(state, dict) and state.get("kind"), name
        loader.load_state_dict(state)
        assert isinstance(loader.epoch, float), name
        assert loader.packs_per_epoch is None if name == "online" else loader.packs_per_epoch > 0, name
        assert (loader.num_steps(1) is None) == (name in ("online", "list")), name
        assert isinstance(loader.info.source_names, tuple), name
    assert loaders["fixed"].info.num_buckets >= 3 and loaders["fixed"].info.fingerprint


def test_the_training_loop_does_not_probe_loaders():
    """No getattr / hasattr on a loader, a sampler, a dataset or a step plan in training/loop.py (issue 23: 14)."""
    tree = ast.parse((ROOT / "megatron_pack" / "training" / "loop.py").read_text())
    probes = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")]
    about_data = [p for p in probes if any(w in p for w in ("loader", "sampler", "dataset", "validation", "step_info"))]
    assert not about_data, about_data
    assert all("model" in p for p in probes), probes  # what is left reads the model (issue 23 item 3)
