"""``PackedSFTDataset``: a token store plus a packing plan, read by O(1) memory-mapped slicing.

``len(ds)`` is the number of packs; ``ds[i]`` is pack ``i`` as the list of per-sample dicts that
``megatron_pack.data.thd.collate_thd`` takes::

    >>> ds = PackedSFTDataset("data/synthetic")          # the only plan, or pass plan_dir
    >>> [s["sample_id"] for s in ds[0]]                   # store sample indices in this pack
    [1207, 88, 3051]
    >>> ds[0][0]["input_ids"][-1] == ds.metadata["eos_id"], ds[0][0]["loss_mask"].dtype
    (True, dtype('int64'))

Opening validates the format version, the sha256 of every array (once per process, cached by
file size and mtime) and, when given, that the tokenizer is the one the training config names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_pack.data.atomic import read_json, sha256_file
from megatron_pack.data.plan import PLAN_FORMAT, PLAN_FORMAT_VERSION, PlanSettings
from megatron_pack.data.sources import DataError
from megatron_pack.data.store import STORE_FORMAT, STORE_FORMAT_VERSION, TokenStore

_VERIFIED: dict[tuple[str, int, int], str] = {}


def verify_files(directory: Path, files: dict) -> list[str]:
    """Problems with the files listed in a metadata ``files`` dict (missing, size or sha256 mismatch)."""
    problems = []
    for name, expected in sorted(files.items()):
        path = Path(directory) / name
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if stat.st_size != expected["size"]:
            problems.append(f"{path} has {stat.st_size} bytes, metadata says {expected['size']}")
            continue
        digest = _VERIFIED.get(key) or sha256_file(path)
        if digest != expected["sha256"]:
            problems.append(f"{path} sha256 {digest[:12]}... differs from metadata {expected['sha256'][:12]}...")
            continue
        _VERIFIED[key] = digest
    return problems


def read_metadata(directory: Path, fmt: str, version: int) -> dict:
    """A store or plan ``metadata.json``, checked for format, version and file checksums."""
    path = Path(directory) / "metadata.json"
    if not path.is_file():
        raise DataError(f"{directory} has no metadata.json, so it is not a prepared dataset; "
                        "run `megatron-pack prepare data.dataset_dir=...` first.")
    meta = read_json(path)
    if meta.get("format") != fmt or meta.get("format_version") != version:
        raise DataError(f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}, this "
                        f"megatron_pack reads {fmt!r} version {version}; re-run `megatron-pack prepare`.")
    problems = verify_files(directory, meta.get("files", {}))
    if problems:
        raise DataError(f"{directory} is damaged: " + "; ".join(problems) +
                        ". Delete it and re-run `megatron-pack prepare`.")
    return meta


def check_tokenizer(identity: dict, expected, where: str) -> None:
    """Refuse a dataset tokenized with another tokenizer than ``expected`` (name, object or identity)."""
    if expected is None:
        return
    if isinstance(expected, str):
        from megatron_pack.data.tokenizer import build_tokenizer

        expected = build_tokenizer(expected)
    want = expected if isinstance(expected, dict) else expected.identity()
    keys = ("vocab_size", "vocab_hash", "special_ids")
    if any(identity.get(k) != want.get(k) for k in keys):
        raise DataError(f"{where} was tokenized with tokenizer {identity.get('name')!r} (vocab {identity.get('vocab_size')}, "
                        f"hash {str(identity.get('vocab_hash'))[:12]}, special ids {identity.get('special_ids')}), but "
                        f"training uses {want.get('name')!r} (vocab {want.get('vocab_size')}, hash "
                        f"{str(want.get('vocab_hash'))[:12]}, special ids {want.get('special_ids')}); set data.tokenizer to "
                        "the tokenizer the dataset was prepared with, or re-run `megatron-pack prepare` with this one.")


def list_plans(dataset_dir: Path) -> list[Path]:
    plans = Path(dataset_dir) / "plans"
    return sorted(p for p in plans.iterdir() if p.is_dir() and not p.name.startswith(".")) if plans.is_dir() else []


class PackedSFTDataset:
    """Packs of samples from a prepared dataset directory (token store + plan)."""

    def __init__(self, dataset_dir, plan_dir=None, *, expected_tokenizer=None):
        self.dataset_dir = Path(dataset_dir)
        self.store_metadata = read_metadata(self.dataset_dir, STORE_FORMAT, STORE_FORMAT_VERSION)
        check_tokenizer(self.store_metadata["tokenizer"], expected_tokenizer, str(self.dataset_dir))
        self.plan_dir = self._resolve_plan(plan_dir)
        self.metadata = read_metadata(self.plan_dir, PLAN_FORMAT, PLAN_FORMAT_VERSION)
        if self.metadata["store_fingerprint"] != self.store_metadata["fingerprint"]:
            raise DataError(f"plan {self.plan_dir} was made for another token store; re-run `megatron-pack prepare`.")
        self._open_arrays()

    def _open_arrays(self) -> None:
        self.store = TokenStore(self.dataset_dir, self.store_metadata)
        load = lambda name: np.load(self.plan_dir / f"{name}.npy", mmap_mode="r", allow_pickle=False)  # noqa: E731
        self.bin_offsets, self.sample_order, self.sample_num_ids = (
            load("bin_offsets"), load("sample_order"), load("sample_num_ids"))

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
    def from_config(cls, cfg) -> "PackedSFTDataset":
        """The dataset at ``data.dataset_dir`` with the plan matching ``cfg``'s packing settings."""
        from megatron_pack.data.prepare import plan_settings

        dataset_dir = Path(cfg.data.dataset_dir)
        fix = (f"run `megatron-pack prepare data.dataset_dir={dataset_dir} "
               f"packing.packed_sequence_size={cfg.packing.packed_sequence_size} ...` with the same config first")
        if not (dataset_dir / "metadata.json").is_file():
            raise DataError(f"data.dataset_dir ({dataset_dir}) holds no prepared dataset; {fix}.")
        store_meta = read_json(dataset_dir / "metadata.json")
        settings = plan_settings(cfg)
        plan_dir = dataset_dir / "plans" / settings.dirname(store_meta.get("fingerprint", ""))
        if not plan_dir.is_dir():
            have = ", ".join(p.name for p in list_plans(dataset_dir)) or "none"
            raise DataError(f"{dataset_dir} has no packing plan for {_describe(settings)} (plans there: {have}); {fix}.")
        dataset = cls(dataset_dir, plan_dir, expected_tokenizer=cfg.data.tokenizer)
        expected = settings.fingerprint(dataset.store_metadata["fingerprint"])
        if dataset.metadata.get("fingerprint") != expected:  # a plan copied or renamed into this name
            raise DataError(f"plan {plan_dir} holds a plan made with other settings (fingerprint "
                            f"{str(dataset.metadata.get('fingerprint'))[:12]}, expected {expected[:12]} for "
                            f"{_describe(settings)}); delete it and {fix}.")
        return dataset

    def __len__(self) -> int:
        return len(self.bin_offsets) - 1

    def sample_ids(self, i: int) -> np.ndarray:
        """Store sample indices in pack ``i``."""
        return np.asarray(self.sample_order[self.bin_offsets[i]:self.bin_offsets[i + 1]])

    def __getitem__(self, i: int) -> list[dict]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"pack {i} out of range for {len(self)} packs")
        i = i % len(self)
        lo, hi = int(self.bin_offsets[i]), int(self.bin_offsets[i + 1])
        samples = []
        for sample_id, num_ids in zip(self.sample_order[lo:hi].tolist(), self.sample_num_ids[lo:hi].tolist()):
            start = int(self.store.offsets[sample_id])
            samples.append({"input_ids": self.store.tokens[start:start + num_ids].astype(np.int64),
                            "loss_mask": self.store.answer_mask[start:start + num_ids].astype(np.int64),
                            "sample_id": sample_id})
        return samples


def _describe(settings: PlanSettings) -> str:
    return (f"pack size {settings.pack_size}, pad multiple {settings.pad_multiple}, algorithm {settings.algorithm}, "
            f"seed {settings.seed}, on_overflow {settings.on_overflow}, max length {settings.max_length}")
