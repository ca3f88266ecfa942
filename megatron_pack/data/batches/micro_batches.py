"""``MicroBatchDataset``: the token store as micro-batches of samples, packed at collate time.

The dataset of ``packing.mode=in_batch`` (no offline plan): item ``i`` is micro-batch ``i``, a list
of up to ``train.micro_batch_size`` samples in the per-sample dict format of ``collate_thd``, which
``megatron_pack.data.batches.in_batch.collate_in_batch`` packs into one THD row with the CP/TP pad
multiple. The samples kept and their lengths follow the offline rules (``select_samples``):
a sample without answer tokens is dropped and counted; a sample longer than ``model.seq_length``
(its RoPE positions; ``packing.max_single_sequence_length`` when lower) follows
``packing.on_overflow``. Kept samples are shuffled once (``packing.seed``) and cut into groups of
``micro_batch_size``; the last group holds the remainder (per-token loss weighs it rightly), so
nothing is left out. ``steps.StepLoader`` then orders and deals the groups over DP ranks as it does packs.

    >>> ds = MicroBatchDataset("data/synthetic", micro_batch_size=4, max_length=512)
    >>> len(ds), [s["sample_id"] for s in ds[0]]
    (1000, [1207, 88, 3051, 12])
"""

from __future__ import annotations

from pathlib import Path
import numpy as np

from megatron_pack.data.batches.dataset import BinnedSamples
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.packing.plan import select_samples
from megatron_pack.data.store.metadata import PlanSettings, check_tokenizer, read_metadata
from megatron_pack.data.store.token_store import STORE_FORMAT, STORE_FORMAT_VERSION, TokenStore


class MicroBatchDataset(BinnedSamples):
    """Micro-batches of samples from a token store (see the module docstring)."""

    item_name = "micro-batch"

    plan_dir = None
    """No packing plan: micro-batches are packed at collate time."""
    bin_bucket = None
    """No length buckets (packing.buckets needs an offline plan)."""

    def __init__(self, dataset_dir, *, micro_batch_size: int, max_length: int, pad_multiple: int = 1,
                 on_overflow: str = "error", seed: int = 0, expected_tokenizer=None):
        self.dataset_dir = Path(dataset_dir)
        self.store_metadata = read_metadata(self.dataset_dir, STORE_FORMAT, STORE_FORMAT_VERSION)
        check_tokenizer(self.store_metadata["tokenizer"], expected_tokenizer, str(self.dataset_dir))
        self.store = TokenStore(self.dataset_dir, self.store_metadata)
        settings = PlanSettings(pack_size=max_length, pad_multiple=pad_multiple, algorithm="in_batch", seed=seed,
                                on_overflow=on_overflow, max_length=max_length)
        try:
            selection = select_samples(self.store, settings)
        except DataError as exc:  # the offline message names packing.packed_sequence_size; here it is seq_length
            raise DataError(str(exc).replace("packing.packed_sequence_size", "model.seq_length")) from None
        order = np.random.default_rng(seed).permutation(len(selection.kept))
        self.sample_order, self.sample_num_ids = selection.kept[order], selection.num_ids[order]
        num_groups = -(-len(order) // micro_batch_size)
        self.bin_offsets = np.minimum(np.arange(num_groups + 1) * micro_batch_size, len(order))
        self.metadata = {
            "micro_batch_size": micro_batch_size, "max_length": max_length, "pad_seq_to_mult": pad_multiple,
            "num_micro_batches": int(num_groups), "pad_id": self.store_metadata.get("pad_id", 0),
            "eos_id": self.store_metadata.get("eos_id"), "vocab_size": self.store_metadata.get("vocab_size"),
            "accounting": {"num_samples_read": len(self.store), "num_samples_packed": int(len(order)),
                           "num_samples_dropped": selection.dropped, "num_samples_truncated": selection.num_truncated},
        }

    @classmethod
    def from_config(cls, cfg, *, check_tokenizer: bool = True) -> "MicroBatchDataset":
        from megatron_pack.config.layout import effective_pad_multiple

        longest = min(cfg.packing.max_single_sequence_length or cfg.model.seq_length, cfg.model.seq_length)
        return cls(cfg.data.dataset_dir, micro_batch_size=cfg.train.micro_batch_size, max_length=longest,
                   pad_multiple=effective_pad_multiple(cfg), on_overflow=cfg.packing.on_overflow,
                   seed=cfg.packing.seed, expected_tokenizer=cfg.data.tokenizer if check_tokenizer else None)

    def __getitem__(self, i: int) -> list[dict]:
        _, lo, hi = self._bin(i)
        samples = []
        for sample_id, num_ids in zip(self.sample_order[lo:hi].tolist(), self.sample_num_ids[lo:hi].tolist()):
            start = int(self.store.offsets[sample_id])
            samples.append({"input_ids": self.store.tokens[start:start + num_ids].astype(np.int64),
                            "loss_mask": self.store.answer_mask[start:start + num_ids].astype(np.int64),
                            "sample_id": sample_id})
            if self.store.images is not None:
                samples[-1]["images"] = self.store.images.sample_images(sample_id, num_ids)
        return samples

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("store")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.store = TokenStore(self.dataset_dir, self.store_metadata)

