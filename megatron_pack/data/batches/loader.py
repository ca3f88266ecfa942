"""The one place a config becomes batches: open the prepared dataset, make its collate, build the loader.

``megatron-pack train`` and ``megatron-pack verify`` (and the tests) go through these three
functions, so the collate every path uses is configured once::

    dataset = open_dataset(cfg)                                   # the plan matching cfg.packing (or, with
                                                                  # packing.in_batch, micro-batches of samples)
    collate = collate_from_config(cfg, dataset.metadata)          # one pack -> one THD batch
    loader = build_loader(cfg, dataset, dp_rank=0, dp_size=2)     # this DP rank's resumable packs

The data layer knows no process group: the caller passes this process's data-parallel rank and
size (``megatron_pack.training.loop.build_loader`` passes them from its ``ParallelState``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Mapping, Sequence

from megatron_pack.config.layout import effective_pad_multiple
from megatron_pack.config.schema import Config
from megatron_pack.data.batches.dataset import PackedSFTDataset
from megatron_pack.data.batches.in_batch import collate_in_batch
from megatron_pack.data.batches.micro_batches import MicroBatchDataset
from megatron_pack.data.batches.sampler import PackLoader, PackSampler, build_pack_loader
from megatron_pack.data.batches.thd import make_collate_fn

log = logging.getLogger("megatron_pack.train")


def open_dataset(cfg: Config, *, plan_dir=None, check_tokenizer: bool = True) -> PackedSFTDataset | MicroBatchDataset:
    """The prepared packed dataset for ``cfg`` (raises ``DataError`` naming the prepare command);
    with ``packing.in_batch`` the token store as micro-batches of ``train.micro_batch_size`` samples.

    ``plan_dir`` is the plan ``megatron_pack.data.store.recorded.choose_plan`` picked (default: the
    one named by ``cfg.packing``); ``check_tokenizer=False`` when ``data.tokenizer`` was read from
    the dataset itself (``megatron_pack.cli.run_config``).
    """
    if cfg.packing.in_batch:
        return MicroBatchDataset.from_config(cfg, check_tokenizer=check_tokenizer)
    return PackedSFTDataset.from_config(cfg, plan_dir=plan_dir, check_tokenizer=check_tokenizer)


def collate_from_config(cfg: Config, metadata: Mapping[str, Any]) -> Callable[[Sequence[Mapping[str, Any]]], dict]:
    """The collate of ``cfg``: pack size, pad multiple and pad id from the dataset's plan ``metadata``,
    the fixed-shape switches (``data.pad_to_max_length``, ``packing.pad_cu_seqlens``) from the config.
    With ``packing.in_batch``: ``collate_in_batch`` (one micro-batch of samples -> one THD row) at the
    config's pad multiple (packing.pad_seq_to_mult or the CP/TP rule)."""
    if cfg.packing.in_batch:
        return functools.partial(collate_in_batch, pad_multiple=effective_pad_multiple(cfg),
                                 pad_id=int(metadata.get("pad_id", 0)))
    return make_collate_fn(metadata, pad_to_max_length=cfg.data.pad_to_max_length,
                           pad_cu_seqlens=cfg.packing.pad_cu_seqlens)


def num_packs_left_out(num_packs: int, dp_size: int) -> int:
    """Packs each epoch leaves out so every DP rank gets as many (``PackSampler``'s drop_last)."""
    return num_packs % dp_size


def build_loader(cfg: Config, dataset: PackedSFTDataset, *, dp_rank: int, dp_size: int,
                 pin_memory: bool = False, announce: bool = True) -> PackLoader:
    """This DP rank's resumable loader of full THD packs: ``PackSampler`` (seeded by ``train.seed``,
    dealt over DP ranks; every CP/TP rank of a DP rank reads the same packs) and
    ``collate_from_config``. ``announce`` logs the packs each epoch leaves out (one rank should)."""
    sampler = PackSampler(len(dataset), dp_rank=dp_rank, dp_size=dp_size, seed=cfg.train.seed)
    left_out = num_packs_left_out(len(dataset), dp_size)
    if left_out and announce:  # count and report, never silent
        log.warning("%d packs do not split evenly over %d data-parallel ranks: each epoch trains %d of them and "
                    "leaves out the last %d of its shuffled order (a different %d each epoch); use a data-parallel "
                    "size that divides %d to train every pack every epoch.", len(dataset), dp_size,
                    len(dataset) - left_out, left_out, left_out, len(dataset))
    return build_pack_loader(dataset, collate_from_config(cfg, dataset.metadata), sampler,
                             num_workers=cfg.data.num_workers, pin_memory=pin_memory)
