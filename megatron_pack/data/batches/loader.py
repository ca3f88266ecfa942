"""The one place a config becomes batches: open the prepared dataset, make its collate, build the loader.

``megatron-pack train`` and ``megatron-pack verify`` (and the tests) go through these three
functions, so the collate every path uses is configured once::

    dataset = open_dataset(cfg)                                   # the plan matching cfg.packing (or the online
                                                                  # source; with packing.mode=in_batch, micro-batches)
    collate = collate_from_config(cfg, dataset.metadata)          # one pack -> one THD batch
    loader = build_loader(cfg, dataset, dp_rank=0, dp_size=2)     # this DP rank's resumable packs

``build_loader`` gives one of two loaders, both ``protocol.BatchLoader`` s: planned steps over
the prepared packs or in-batch micro-batches (``StepLoader``, ``steps.py``: a fixed global batch
or a token budget, dealt round-robin or balanced, over one ``sampler.EpochOrder``), or online
packs from this rank's shards (``OnlineLoader``, ``online.py``). The loop calls ``begin_step()``
before each step's micro-batches. ``step_planner`` is the planner alone (no rank), which counts
the steps of ``train.num_epochs`` before any process group starts.

The data layer knows no process group: the caller passes this process's data-parallel rank and
size (``megatron_pack.training.loop.build_loader`` passes them from its ``ParallelState``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from megatron_pack.config.layout import effective_pack_multiple, effective_pad_multiple
from megatron_pack.config.schema import Config
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.batches.in_batch import collate_in_batch
from megatron_pack.data.batches.online import Gather, OnlineLoader, OnlineSource, online_packing_record, single_rank
from megatron_pack.data.batches.online_feed import PackFeed, PackMaker
from megatron_pack.data.batches.protocol import loader_info
from megatron_pack.data.batches.steps import StepLoader, StepPlanner, StepRule, pack_stats
from megatron_pack.data.batches.thd import make_collate_fn
from megatron_pack.data.batches.vlm import image_collate
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.packing.order import EpochOrder


log = logging.getLogger("megatron_pack.train")


def collate_from_config(cfg: Config, metadata: Mapping[str, Any]) -> Callable[[Sequence[Mapping[str, Any]]], dict]:
    """The collate of ``cfg``: pack size, pad multiple and pad id from the dataset's plan ``metadata``,
    the fixed-shape switches (``data.pad_to_max_length``, ``packing.pad_cu_seqlens``) and the pack
    multiple (``model.fp8`` with the layout: ``config.layout.pack_multiple``) from the config.
    With ``packing.mode=in_batch``: ``collate_in_batch`` (one micro-batch of samples -> one THD row) at the
    config's pad multiple (packing.pad_seq_to_mult or the CP/TP rule) and pack multiple."""
    if cfg.packing.mode == "in_batch":
        return functools.partial(collate_in_batch, pad_multiple=effective_pad_multiple(cfg),
                                 pad_id=int(metadata.get("pad_id", 0)), pack_multiple=effective_pack_multiple(cfg))
    return make_collate_fn(metadata, pad_to_max_length=cfg.data.pad_to_max_length,
                           pad_cu_seqlens=cfg.packing.pad_cu_seqlens, pack_multiple=effective_pack_multiple(cfg))


def dataset_collate(cfg: Config, dataset, *, stop_on_problem: bool = False) -> Callable[[Sequence[Mapping[str, Any]]], dict]:
    """``collate_from_config`` for ``dataset``, with the images, pixels and M-RoPE positions of a store with
    images (``vlm.with_images``; ``stop_on_problem``: training's loader, which stops the run on a changed image)."""
    return image_collate(collate_from_config(cfg, dataset.metadata), getattr(dataset, "store_metadata", {}),
                         in_batch=cfg.packing.mode == "in_batch", stop_on_problem=stop_on_problem)


def num_packs_left_out(num_packs: int, dp_size: int) -> int:
    """Packs each fixed-batch epoch leaves out so every DP rank gets as many (``steps.StepPlanner``)."""
    return num_packs % dp_size


def bucket_groups(cfg: Config, dataset: PackedSFTDataset):
    """Each pack's length bucket when ``packing.bucket_order=sequential`` (the epoch order keeps buckets
    apart, for every step rule and deal), else None (one shuffle over all packs)."""
    if cfg.packing.bucket_order != "sequential":
        return None
    groups = dataset.bin_bucket
    if groups is None:
        raise ValueError(f"packing.bucket_order=sequential needs a bucketed plan, but {dataset.plan_dir} has no "
                         "length buckets; set packing.buckets and re-run `megatron-pack prepare`.")
    return np.asarray(groups)


def build_loader(cfg: Config, dataset: PackedSFTDataset | MicroBatchDataset | OnlineSource, *, dp_rank: int,
                 dp_size: int, pin_memory: bool = False, announce: bool = True, gather: Gather = single_rank
                 ) -> StepLoader | OnlineLoader:
    """This DP rank's resumable loader (a ``protocol.BatchLoader``) for ``dataset`` (from ``open_dataset``):

    - ``packing.mode=online``: ``OnlineLoader`` over this DP rank's shards (``online_loader``; ``gather``
      all-gathers over the data-parallel group, for the global token budget and balancing);
    - otherwise ``StepLoader`` over ``step_planner``'s steps: a fixed ``train.global_batch_size`` or a
      ``train.global_batch_tokens`` budget, dealt round-robin or by cost (``packing.balance``).

    Every CP/TP rank of a DP rank reads the same packs. ``announce`` logs the packs each epoch
    leaves out (one rank should)."""
    if isinstance(dataset, OnlineSource):
        return online_loader(cfg, dataset, dp_rank=dp_rank, dp_size=dp_size, announce=announce, gather=gather,
                             pin_memory=pin_memory)
    planner = step_planner(cfg, dataset, dp_size)
    left_out = num_packs_left_out(len(dataset), dp_size)
    if left_out and announce and planner.rule.global_batch_tokens is None:  # count and report, never silent
        log.warning("%d packs do not split evenly over %d data-parallel ranks: each epoch trains %d of them and "
                    "leaves out the last %d of its shuffled order (a different %d each epoch); use a data-parallel "
                    "size that divides %d to train every pack every epoch.", len(dataset), dp_size,
                    len(dataset) - left_out, left_out, left_out, len(dataset))
    return StepLoader(dataset, dataset_collate(cfg, dataset, stop_on_problem=True), planner, dp_rank=dp_rank,
                      seed=cfg.train.seed, num_workers=cfg.data.num_workers, pin_memory=pin_memory,
                      info=loader_info(dataset.metadata), bucket_order=cfg.packing.bucket_order)


def step_rule(cfg: Config, dp_size: int) -> StepRule:
    """How ``cfg`` cuts and deals steps (``megatron_pack.data.batches.steps``): a fixed count of
    ``train.global_batch_size`` packs (in-batch: / ``train.micro_batch_size`` micro-batches) or a budget."""
    t = cfg.train
    per_step = t.global_batch_size // t.micro_batch_size if cfg.packing.mode == "in_batch" else t.global_batch_size
    return StepRule(dp_size=dp_size, global_batch_size=per_step, global_batch_tokens=t.global_batch_tokens,
                    budget_kind=t.token_budget, balance=cfg.packing.balance, cost_a=cfg.packing.cost_a,
                    cost_b=cfg.packing.cost_b, pp_size=cfg.parallel.pipeline_model_parallel_size)


def step_planner(cfg: Config, dataset: PackedSFTDataset | MicroBatchDataset, dp_size: int) -> StepPlanner:
    """The steps of ``cfg`` over the offline packs (or in-batch micro-batches) at ``dp_size`` DP ranks,
    the same on every rank; raises ``DataError`` when the data cannot fill one step."""
    rule = step_rule(cfg, dp_size)
    stats = pack_stats(dataset) if rule.global_batch_tokens is not None or rule.balance == "dp" else None
    held = f"{len(dataset)} {dataset.item_name}s"
    if len(dataset) < dp_size:
        raise DataError(f"the packed dataset ({held}) cannot give each of {dp_size} data-parallel ranks one per "
                        "epoch; use fewer data-parallel ranks or prepare more data.")
    if rule.global_batch_tokens is not None:
        budget = stats.target_tokens if rule.budget_kind == "target" else stats.real_tokens
        if int(budget.sum()) < rule.global_batch_tokens:
            raise DataError(f"the packed dataset ({held}, {int(budget.sum())} {rule.budget_kind} tokens) cannot fill "
                            f"one step of train.global_batch_tokens={rule.global_batch_tokens} {rule.budget_kind} "
                            f"tokens over {dp_size} data-parallel ranks; lower it or prepare more data.")
    order = EpochOrder(len(dataset), cfg.train.seed, bucket_groups(cfg, dataset))
    return StepPlanner(stats, order, rule)


def online_loader(cfg: Config, source: OnlineSource, *, dp_rank: int, dp_size: int, announce: bool = True,
                  gather: Gather = single_rank, pin_memory: bool = False) -> OnlineLoader:
    """Online packs of this DP rank's shards (``data.num_workers`` of them, made in DataLoader workers,
    or one made in this process); the steps are selected over the DP group (``OnlineLoader``).
    ``announce`` logs each shard's per-epoch accounting (one rank per DP rank should)."""
    p, t = cfg.packing, cfg.train
    num_shards = dp_size * max(cfg.data.num_workers, 1)
    if source.store is not None and len(source.store) < num_shards:  # the same answer on every rank
        raise DataError(f"packing.mode=online splits the token store into {num_shards} shards (data-parallel size "
                        f"{dp_size} x max(data.num_workers={cfg.data.num_workers}, 1)) but it holds only "
                        f"{len(source.store)} samples, so a shard would be empty; "
                        + (f"set data.num_workers={len(source.store) // dp_size} or fewer, or prepare more data."
                           if len(source.store) >= dp_size else
                           f"run on at most {len(source.store)} data-parallel ranks, or prepare more data."))
    collate = collate_from_config(cfg, source.metadata)
    maker = PackMaker(source.pack_stream, collate, cost_a=p.cost_a, cost_b=p.cost_b,
                      keep_samples=p.balance == "dp" and source.store is None and dp_size > 1)
    feed = PackFeed(maker, dp_rank=dp_rank, dp_size=dp_size, num_workers=cfg.data.num_workers, pin_memory=pin_memory)
    return OnlineLoader(feed, collate, packs_per_step=t.global_batch_size // dp_size,
                        budget_tokens=t.global_batch_tokens, budget_kind=t.token_budget, balance=p.balance,
                        gather=gather, samples_of=source.samples_of, announce=announce,
                        num_workers=cfg.data.num_workers, packing=online_packing_record(cfg),
                        pp_size=cfg.parallel.pipeline_model_parallel_size)
