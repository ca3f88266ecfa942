"""``PackedSFTDataset``: a token store plus a packing plan, read by O(1) memory-mapped slicing.

``len(ds)`` is the number of packs; ``ds[i]`` is pack ``i`` as the list of per-sample dicts that
``megatron_pack.data.batches.thd.collate_thd`` takes::

    >>> ds = PackedSFTDataset("data/synthetic")          # the only plan, or pass plan_dir
    >>> [s["sample_id"] for s in ds[0]]                   # store sample indices in this pack
    [1207, 88, 3051]
    >>> ds[0][0]["input_ids"][-1] == ds.metadata["eos_id"], ds[0][0]["loss_mask"].dtype
    (True, dtype('int64'))

A split or wrapped plan (``packing.on_overflow=split``, ``packing.algorithm=wrapped``) packs
pieces: its samples also carry ``piece`` (0, 1, ... inside the sample; ``input_ids`` is the
piece's slice, and a later piece's repeated context has loss_mask 0). A bucketed plan's samples
carry ``bucket`` (the pack's length bucket); a mixed plan's (``data.sources``) carry ``source``
(an index into ``ds.source_names``).

Opening validates the format version, the sha256 of every array (once per process, cached by
file size and mtime), that the manifest hashes to the plan's fingerprint and name (else the plan is
damaged) and, when given, that the tokenizer is the one the training config names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.packing.split import piece_loss_mask
from megatron_pack.data.store.atomic import read_json
from megatron_pack.data.store.manifest import build_manifest, dirname, integrity_problems
from megatron_pack.data.store.metadata import (PLAN_FORMAT, PLAN_FORMAT_VERSION, VALIDATION_DIRNAME, check_tokenizer,
                                               list_plans, read_metadata)
from megatron_pack.data.store.token_store import STORE_FORMAT, STORE_FORMAT_VERSION, TokenStore

def _expected_tokenizer(cfg):
    """The config's tokenizer name, or the tokenizer itself when data.chat_template replaces its template
    (the template is part of the identity the dataset was prepared with)."""
    if getattr(cfg.data, "chat_template", None) is None:
        return cfg.data.tokenizer
    from megatron_pack.data.formats.tokenizer import build_tokenizer

    return build_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)


class BinnedSamples:
    """Items that are bins of store samples: item ``i`` holds ``sample_order[bin_offsets[i]:bin_offsets[i+1]]``
    (packs of a plan, or the micro-batches of in-batch packing). ``item_name`` names an item in errors."""

    item_name = "item"

    def __len__(self) -> int:
        return len(self.bin_offsets) - 1

    def sample_ids(self, i: int) -> np.ndarray:
        """Store sample indices in item ``i``."""
        return np.asarray(self.sample_order[self.bin_offsets[i]:self.bin_offsets[i + 1]])

    def _bin(self, i: int) -> tuple[int, int, int]:
        """``(i, lo, hi)``: ``i`` made non-negative, and its slice of the sample arrays (IndexError out of range)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self.item_name} {i} out of range for {len(self)} {self.item_name}s")
        i = i % len(self)
        return i, int(self.bin_offsets[i]), int(self.bin_offsets[i + 1])


class PackedSFTDataset(BinnedSamples):
    """Packs of samples from a prepared dataset directory (token store + plan)."""

    item_name = "pack"

    def __init__(self, dataset_dir, plan_dir=None, *, expected_tokenizer=None):
        self.dataset_dir = Path(dataset_dir)
        self.store_metadata = read_metadata(self.dataset_dir, STORE_FORMAT, STORE_FORMAT_VERSION)
        check_tokenizer(self.store_metadata["tokenizer"], expected_tokenizer, str(self.dataset_dir))
        self.plan_dir = self._resolve_plan(plan_dir)
        self.metadata = read_metadata(self.plan_dir, PLAN_FORMAT, PLAN_FORMAT_VERSION)
        if self.metadata["store_fingerprint"] != self.store_metadata["fingerprint"]:
            raise DataError(f"plan {self.plan_dir} was made for another token store; re-run `megatron-pack prepare`.")
        named = self.plan_dir.parent if self.plan_dir.name == VALIDATION_DIRNAME else self.plan_dir
        problems = integrity_problems(named, self.metadata)
        if problems:
            raise DataError(f"plan {self.plan_dir} is damaged: {'; '.join(problems)}. Delete it and re-run "
                            "`megatron-pack prepare`.")
        self._open_arrays()

    @property
    def manifest(self) -> dict:
        """Every setting that shaped the plan, by config key (``megatron_pack.data.store.manifest``)."""
        return self.metadata["manifest"]

    def _open_arrays(self) -> None:
        self.store = TokenStore(self.dataset_dir, self.store_metadata)
        load = lambda name: np.load(self.plan_dir / f"{name}.npy", mmap_mode="r", allow_pickle=False)  # noqa: E731
        self.bin_offsets, self.sample_order, self.sample_num_ids = (
            load("bin_offsets"), load("sample_order"), load("sample_num_ids"))
        files = self.metadata.get("files", {})
        optional = {name: load(name) if f"{name}.npy" in files else None
                    for name in ("sample_start", "sample_piece", "bin_bucket", "sample_source")}
        self.sample_start, self.sample_piece, self.bin_bucket, self.sample_source = (
            optional["sample_start"], optional["sample_piece"], optional["bin_bucket"], optional["sample_source"])
        self.split_overlap = int(self.metadata.get("split_overlap", 0))

    @property
    def num_buckets(self) -> int:
        """Length buckets of the plan (1 without packing.buckets)."""
        return len(self.metadata.get("buckets", {}).get("per_bucket", [])) or 1

    @property
    def source_names(self) -> list[str]:
        """Names of data.sources, indexed by a sample's ``source`` (empty for a single input)."""
        return list(self.metadata.get("source_names", []))

    def pack_bucket(self, i: int) -> int:
        """The length bucket of pack ``i`` (0 without packing.buckets)."""
        return int(self.bin_bucket[i]) if self.bin_bucket is not None else 0

    def __getstate__(self) -> dict:
        """Paths and metadata only (for spawned DataLoader workers): the arrays are re-mapped, not copied."""
        return {k: getattr(self, k) for k in ("dataset_dir", "plan_dir", "metadata", "store_metadata")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open_arrays()  # verified by the process that opened the dataset

    def _resolve_plan(self, plan_dir) -> Path:
        if plan_dir is not None:
            plan_dir = Path(plan_dir)
            return plan_dir if plan_dir.is_absolute() or plan_dir.exists() else self.dataset_dir / "plans" / plan_dir
        plans = list_plans(self.dataset_dir)
        if len(plans) != 1:
            names = ", ".join(p.name for p in plans) or "none"
            raise DataError(f"{self.dataset_dir} has {len(plans)} packing plans ({names}); pass plan_dir=... or use "
                            "PackedSFTDataset.from_config(cfg), which picks the plan matching the config.")
        return plans[0]

    @classmethod
    def from_config(cls, cfg, *, plan_dir=None, check_tokenizer: bool = True) -> "PackedSFTDataset":
        """The dataset at ``data.dataset_dir`` with ``plan_dir``, or the plan ``cfg`` describes (the one
        ``prepare(cfg)`` writes: the folder its manifest names).

        ``plan_dir`` is what ``megatron_pack.data.store.recorded.choose_plan`` picked from the manifests;
        ``check_tokenizer=False`` skips rebuilding ``data.tokenizer`` when it was read from the dataset itself.
        """
        dataset_dir = Path(cfg.data.dataset_dir)
        fix = (f"run `megatron-pack prepare data.dataset_dir={dataset_dir} "
               f"packing.packed_sequence_size={cfg.packing.packed_sequence_size} ...` with the same config first")
        if not (dataset_dir / "metadata.json").is_file():
            raise DataError(f"data.dataset_dir ({dataset_dir}) holds no prepared dataset; {fix}.")
        if plan_dir is None:
            store_meta = read_json(dataset_dir / "metadata.json")
            plan_dir = dataset_dir / "plans" / dirname(build_manifest(cfg), store_meta.get("fingerprint", ""))
            if not plan_dir.is_dir():
                have = ", ".join(p.name for p in list_plans(dataset_dir)) or "none"
                raise DataError(f"{dataset_dir} has no packing plan {plan_dir.name} for this config (plans there: "
                                f"{have}); {fix}, or name one with data.plan.")
        return cls(dataset_dir, plan_dir, expected_tokenizer=_expected_tokenizer(cfg) if check_tokenizer else None)

    def __getitem__(self, i: int) -> list[dict]:
        i, lo, hi = self._bin(i)
        starts = self.sample_start[lo:hi].tolist() if self.sample_start is not None else [0] * (hi - lo)
        pieces = self.sample_piece[lo:hi].tolist() if self.sample_piece is not None else [0] * (hi - lo)
        bucket = self.pack_bucket(i)
        sources = self.sample_source[lo:hi].tolist() if self.sample_source is not None else [0] * (hi - lo)
        samples = []
        for sample_id, num_ids, first, piece, source in zip(self.sample_order[lo:hi].tolist(),
                                                            self.sample_num_ids[lo:hi].tolist(), starts, pieces,
                                                            sources):
            start = int(self.store.offsets[sample_id]) + first
            # a split piece's repeated context was trained in the piece before: no loss here
            mask = piece_loss_mask(self.store.answer_mask[start:start + num_ids].astype(np.int64), piece,
                                   self.split_overlap)
            sample = {"input_ids": self.store.tokens[start:start + num_ids].astype(np.int64), "loss_mask": mask,
                      "sample_id": sample_id}
            if self.sample_piece is not None:
                sample["piece"] = piece
            if self.bin_bucket is not None:
                sample["bucket"] = bucket
            if self.sample_source is not None:
                sample["source"] = source
            if self.store.images is not None:  # whole samples only: a plan with images never splits
                sample["images"] = self.store.images.sample_images(sample_id, num_ids)
                if sample["images"]:  # an image that changed since prepare is named with its record
                    sample["where"] = self.store.where(sample_id)
            samples.append(sample)
        return samples
