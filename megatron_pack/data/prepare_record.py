"""A ``prepare`` that would change nothing, answered without building the tokenizer (no torch, no transformers).

``prepare`` decides what to rebuild from fingerprints that include the tokenizer's identity (its
vocabulary hash), so even a re-run with nothing new loaded the tokenizer first: seconds to tens of
seconds for a folder whose class goes through ``AutoTokenizer``. After a successful run, rank 0 of
a one-process ``prepare`` writes ``<data.dataset_dir>/.prepare_records/<key>.json``, where ``key``
is the sha256 of everything that run read:

- the whole resolved config (every group: a change anywhere is a full re-run, the safe side);
- every input file (``data.input``, ``data.sources``, ``data.validation``): path, size, sha256;
- the tokenizer folder's files except weights (``*.safetensors``, ``*.bin``, ...): name, size, sha256;
  the chat template file (``data.chat_template``);
- the megatron_pack version and the store and plan format versions.

The record lists the files that run left (the token store, its plan, the validation store and
plan, the Megatron-Bridge export) with their size and modification time. A later run computes
the key the same way (hashing the same files, as the full path does anyway) and, when a record
with that key exists and every file it lists is unchanged, prints the same summary and stops: it
has proved its inputs are the ones that made those files. Anything else (no record, another key,
a file missing or touched) runs the full ``prepare``, which verifies checksums as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Optional

from megatron_pack.data.store.atomic import read_json, sha256_file, write_json

RECORDS = ".prepare_records"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
"""Files of a tokenizer folder that are model weights (a model folder doubles as the tokenizer folder)."""
log = logging.getLogger(__name__)


def _input_files(cfg) -> list[Path]:
    from megatron_pack.data.formats.sources import resolve_inputs

    d = cfg.data
    inputs = ([(d.input, d.split)] if d.source == "files" and d.input else []) + [(e["input"], None) for e in d.sources or []]
    inputs += [(d.validation, None)] if d.validation else []
    return [Path(f) for pattern, split in inputs for f in resolve_inputs(pattern, split)]


def _tokenizer_files(cfg) -> list[Path]:
    files = []
    folder = Path(cfg.data.tokenizer)
    if cfg.data.tokenizer != "byte" and folder.is_dir():
        files += sorted(f for f in folder.iterdir() if f.is_file() and f.suffix not in WEIGHT_SUFFIXES)
    if cfg.data.chat_template and Path(cfg.data.chat_template).is_file():
        files.append(Path(cfg.data.chat_template))
    return files


def inputs_key(cfg) -> str:
    """The sha256 naming everything a ``prepare`` of ``cfg`` reads (the module docstring's list)."""
    from megatron_pack import __version__
    from megatron_pack.data.store.metadata import PLAN_FORMAT_VERSION
    from megatron_pack.data.store.token_store import STORE_FORMAT_VERSION

    files = {str(f.resolve()): [f.stat().st_size, sha256_file(f)] for f in _input_files(cfg) + _tokenizer_files(cfg)}
    identity = {"config": dataclasses.asdict(cfg), "files": files, "version": __version__,
                "formats": [STORE_FORMAT_VERSION, PLAN_FORMAT_VERSION]}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def _outputs(dataset_dir: Path, plan_dir: Path) -> dict[str, list[int]]:
    """``{relative path: [size, mtime_ns]}`` of the store's own files, the plan's, and the validation
    store's and its plans' (other plans of the folder are not this run's)."""
    dataset_dir, plan_dir = Path(dataset_dir), Path(plan_dir)
    files = [f for f in dataset_dir.iterdir() if f.is_file()]
    for tree in (plan_dir, dataset_dir / "validation"):
        files += [f for f in tree.rglob("*") if f.is_file()] if tree.is_dir() else []
    return {str(f.relative_to(dataset_dir)): [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(set(files))}


def record(cfg, plan_dir: Path) -> Path:
    """After a successful ``prepare`` of ``cfg`` into ``plan_dir``: write its record; returns the file."""
    dataset_dir = Path(cfg.data.dataset_dir)
    key = inputs_key(cfg)
    path = dataset_dir / RECORDS / f"{key}.json"
    path.parent.mkdir(exist_ok=True)
    write_json(path, {"plan": str(Path(plan_dir).relative_to(dataset_dir)), "outputs": _outputs(dataset_dir, plan_dir)})
    return path


def unchanged_plan(cfg) -> Optional[Path]:
    """The plan a ``prepare`` of ``cfg`` would leave as it is, when that is proved (module docstring); else None."""
    dataset_dir = Path(cfg.data.dataset_dir)
    if not (dataset_dir / RECORDS).is_dir():
        return None
    try:
        path = dataset_dir / RECORDS / f"{inputs_key(cfg)}.json"
        if not path.is_file():
            return None
        saved: dict[str, Any] = read_json(path)
        plan_dir = dataset_dir / saved["plan"]
        if _outputs(dataset_dir, plan_dir) != saved["outputs"]:
            return None
    except (OSError, ValueError, KeyError):  # anything unexpected: the full prepare decides
        return None
    log.info("nothing changed since the prepare that wrote %s (config, input files and tokenizer files hashed); "
             "nothing to do", plan_dir)
    return plan_dir
