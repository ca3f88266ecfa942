"""The on-disk metadata format of a prepared dataset: read it, verify its files, name its plans.

A prepared dataset directory holds a token store (``metadata.json`` with ``format``
``megatron_pack.token_store``) and, under ``plans/``, one directory per packing plan (``format``
``megatron_pack.packing_plan``). Each ``metadata.json`` lists its array files with size and sha256::

    {"format": "megatron_pack.packing_plan", "format_version": 2, "fingerprint": "9f3c...",
     "files": {"bin_offsets.npy": {"size": 1096, "sha256": "..."}, ...}, "manifest": {...}, "pack_size": 512, ...}

A plan's directory name and fingerprint come from its manifest (``megatron_pack.data.store.manifest``:
every setting that shaped it) and the store's fingerprint, so the writer (``megatron_pack.data.prepare``)
and the readers (``megatron_pack.data.batches.dataset``, ``megatron-pack inspect``) agree on one name.
``PlanSettings`` is what the packing code runs with. Both import this module; it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_pack.config.layout import effective_pack_multiple, effective_pad_multiple
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.store.atomic import read_json, sha256_file
from megatron_pack.data.store.manifest import MANIFEST_VERSION

PLAN_FORMAT = "megatron_pack.packing_plan"
PLAN_FORMAT_VERSION = MANIFEST_VERSION
"""2: plans carry a manifest (version 1 plans, written before it, are refused with `re-run prepare`)."""


@dataclass(frozen=True)
class PlanSettings:
    """Everything a plan depends on besides the store."""

    pack_size: int
    pad_multiple: int
    algorithm: str
    seed: int
    on_overflow: str
    max_length: int
    """Longest THD length kept (packing.max_single_sequence_length, default the pack size)."""
    split_overlap: int = 0
    """Context tokens repeated at the start of each following piece (on_overflow=split)."""
    buckets: object = None
    """None, 'auto' or a tuple of THD-length boundaries (packing.buckets)."""
    wrapped_attention: str = "document"
    """'document' or 'cross' (algorithm=wrapped)."""
    mixture: object = None
    """None, or a tuple of (source name, 'weight' | 'tokens', value) from data.sources."""
    validation_fraction: float = 0.0
    """Share of the store's samples held out (by validation_seed, before packing) into a validation plan."""
    validation_seed: int = 0
    pack_multiple: int = 1
    """Multiple each pack's token count is padded to by a tail (model.fp8 with the layout:
    ``config.layout.pack_multiple``); 1 or pad_multiple: no tail rule beyond the pad multiple."""

    @property
    def truncate_to(self) -> int:
        """THD length a truncated sample is cut to: fits the pack after padding."""
        return min(self.max_length, self.pack_size // self.pad_multiple * self.pad_multiple)


def plan_settings(cfg) -> PlanSettings:
    """The plan settings of ``cfg``; the pad multiple is packing.pad_seq_to_mult or the lcm rule."""
    pack_size = cfg.packing.packed_sequence_size
    if pack_size <= 0:
        raise DataError("packing.packed_sequence_size (0) turns offline packing off, so there is nothing to "
                        "prepare; set packing.packed_sequence_size=512 (or another pack size).")
    max_length = cfg.packing.max_single_sequence_length or pack_size
    return PlanSettings(pack_size=pack_size, pad_multiple=effective_pad_multiple(cfg),
                        algorithm=cfg.packing.algorithm, seed=cfg.packing.seed,
                        on_overflow=cfg.packing.on_overflow, max_length=min(max_length, pack_size),
                        split_overlap=cfg.packing.split_overlap, buckets=_buckets(cfg.packing.buckets),
                        wrapped_attention=cfg.packing.wrapped_attention if cfg.packing.algorithm == "wrapped"
                        else "document", mixture=_mixture(cfg.data.sources),
                        validation_fraction=float(cfg.data.validation_fraction),
                        validation_seed=cfg.data.validation_seed, pack_multiple=effective_pack_multiple(cfg))


def _mixture(sources):
    if not sources:
        return None
    return tuple((s["name"], "weight" if s.get("weight") is not None else "tokens",
                  s["weight"] if s.get("weight") is not None else s["tokens"]) for s in sources)


def _buckets(spec):
    return spec if spec is None or spec == "auto" else tuple(int(b) for b in spec)


VALIDATION_DIRNAME = "validation"
"""Where a plan's held-out validation plan sits (``<plan>/validation``) and where ``data.validation``
is prepared (``<data.dataset_dir>/validation``)."""


def held_out_mask(num_samples: int, fraction: float, seed: int) -> "np.ndarray":
    """Boolean [num_samples]: True for the ``round(fraction * num_samples)`` samples held out for
    validation, chosen by a permutation seeded by ``seed`` (independent of packing settings).

    Example: 10 samples, fraction 0.2 -> exactly 2 True, the same 2 for the same seed.
    """
    import numpy as np

    mask = np.zeros(num_samples, dtype=bool)
    mask[np.random.default_rng([seed, 0x5A11D]).permutation(num_samples)[:round(fraction * num_samples)]] = True
    return mask


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
        from megatron_pack.data.formats.tokenizer import build_tokenizer

        expected = build_tokenizer(expected)
    want = expected if isinstance(expected, dict) else expected.identity()
    keys = ("vocab_size", "vocab_hash", "special_ids")
    if any(identity.get(k) != want.get(k) for k in keys):
        raise DataError(f"{where} was tokenized with tokenizer {identity.get('name')!r} (vocab {identity.get('vocab_size')}, "
                        f"hash {str(identity.get('vocab_hash'))[:12]}, special ids {identity.get('special_ids')}), but "
                        f"training uses {want.get('name')!r} (vocab {want.get('vocab_size')}, hash "
                        f"{str(want.get('vocab_hash'))[:12]}, special ids {want.get('special_ids')}; a Hugging Face vocabulary "
                        "hash covers its chat template, data.chat_template included); set data.tokenizer (and "
                        "data.chat_template) to what the dataset was prepared with, or leave them unset (train reads "
                        "them from the dataset), or re-run `megatron-pack prepare` with this one.")


def list_plans(dataset_dir: Path) -> list[Path]:
    plans = Path(dataset_dir) / "plans"
    return sorted(p for p in plans.iterdir() if p.is_dir() and not p.name.startswith(".")) if plans.is_dir() else []
