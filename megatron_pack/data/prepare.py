"""``prepare``: raw records -> token store -> packing plan (+ report, + Megatron-Bridge export).

Idempotent: the store is identified by a fingerprint of its inputs (source files' sha256 or the
synthetic settings, tokenizer identity, schema, answer-only switch) and the plan by a fingerprint
of (store, its manifest: every setting that shaped it, ``megatron_pack.data.store.manifest``); a re-run with
identical inputs and settings finds both complete and does nothing. In a multi-rank job only
global rank 0 writes; the others wait at ``barrier`` and then verify the checksums, retrying for
a while on slow shared filesystems.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from megatron_pack.data.store.atomic import atomic_directory, read_json, sha256_file, write_json
from megatron_pack.data.packing.plan import write_plan
from megatron_pack.data.formats.sources import SUFFIXES, Chunk, DataError, iter_chunks, num_rows, resolve_inputs
from megatron_pack.data.store.manifest import build_manifest, dirname, integrity_problems
from megatron_pack.data.store.metadata import (PLAN_FORMAT, PLAN_FORMAT_VERSION, VALIDATION_DIRNAME, PlanSettings,
                                               plan_settings, read_metadata)
from megatron_pack.data.store.token_store import (STORE_ARRAYS, STORE_FORMAT, STORE_FORMAT_VERSION, TokenStore,
                                      default_num_workers, store_statistics, token_dtype_for, tokenize_stream,
                                      write_store)
from megatron_pack.data.formats.chat import SampleSchema, schema_from_config
from megatron_pack.data.formats.synthetic import GENERATOR_VERSION
from megatron_pack.data.formats.tokenizer import build_tokenizer
from megatron_pack.config.schema import ConfigError
from megatron_pack.config.validate import tokenizer_vocab_problems
from megatron_pack.data.store.images import IMAGE_ARRAYS

log = logging.getLogger(__name__)
SYNTHETIC_CHUNK = 1000
FILE_CHUNK = 512


def _schema(cfg) -> SampleSchema:
    return schema_from_config(cfg.data)


def source_schema(cfg, entry: dict) -> SampleSchema:
    """The schema of one data.sources entry: its own schema keys over the data.* ones."""
    import dataclasses

    from megatron_pack.config.schema import SOURCE_SCHEMA_KEYS

    return schema_from_config(dataclasses.replace(cfg.data, **{k: entry[k] for k in SOURCE_SCHEMA_KEYS if k in entry}))


def _file_schemas(cfg, inputs: dict):
    """One schema per input file (data.sources), or the one schema of data.*."""
    src = inputs["sources"]
    if "mixture" not in src:
        return _schema(cfg)
    per_source = [source_schema(cfg, e) for e in cfg.data.sources]
    return tuple(per_source[f["source"]] for f in src["files"])


def store_inputs(cfg, tokenizer) -> dict:
    """Everything the token store depends on (hashed into its fingerprint)."""
    d = cfg.data
    if d.source == "synthetic":
        max_length = plan_settings(cfg).truncate_to
        sources = {"kind": "synthetic", "seed": d.synthetic_seed, "num_samples": d.synthetic_num_samples,
                   "max_length": max_length, "generator_version": GENERATOR_VERSION,
                   "files": [{"path": f"<synthetic seed={d.synthetic_seed}>", "sha256": None}]}
    elif d.sources:  # data.sources: every source's files, each tagged with its source index
        files = [{"path": str(f), "sha256": sha256_file(f), "size": f.stat().st_size, "source": i}
                 for i, entry in enumerate(d.sources) for f in resolve_inputs(entry["input"])]
        mixture = [{"name": e["name"], "input": e["input"], "schema": source_schema(cfg, e).identity()}
                   for e in d.sources]
        sources = {"kind": "files", "input": [e["input"] for e in d.sources], "files": files, "mixture": mixture}
    elif not d.input:
        raise DataError("data.input (None) is required by prepare when data.source=files; "
                        "set data.input=/path/to/train.jsonl (a file, directory or glob), or data.sources.")
    else:
        files = resolve_inputs(d.input, d.split)
        sources = {"kind": "files", "input": d.input,
                   "files": [{"path": str(f), "sha256": sha256_file(f), "size": f.stat().st_size} for f in files]}
    schema = _schema(cfg)
    skip = {"on_bad_record": d.on_bad_record} if d.on_bad_record != "error" else {}  # older stores keep their names
    return {"sources": sources, "tokenizer": tokenizer.identity(), "answer_only_loss": d.answer_only_loss,
            "schema": schema.identity(), **skip, **_image_inputs(cfg, tokenizer),
            "format_version": STORE_FORMAT_VERSION}


def _image_inputs(cfg, tokenizer) -> dict:
    """The image processor's resize rule and data.image_root, for a tokenizer folder with an image processor
    (``formats.images``); nothing for a text folder, so text stores keep their fingerprints."""
    from megatron_pack.data.formats.images import image_spec

    spec = image_spec(cfg.data.tokenizer, tokenizer)
    if spec is None:
        return {}
    root = cfg.data.image_root
    return {"image_processor": spec.identity(), "image_root": str(Path(root).resolve()) if root else None}


def fingerprint(inputs: dict) -> str:
    identity = {k: v for k, v in inputs.items()}
    identity["sources"] = {k: v for k, v in inputs["sources"].items() if k != "input"}
    identity["sources"]["files"] = [{"name": Path(f["path"]).name, "sha256": f["sha256"],
                                     **({"source": f["source"]} if "source" in f else {})}
                                    for f in inputs["sources"]["files"]]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _chunks(cfg, inputs: dict):
    src = inputs["sources"]
    if src["kind"] == "synthetic":
        n, label = src["num_samples"], src["files"][0]["path"]
        for start in range(0, n, SYNTHETIC_CHUNK):
            stop = min(n, start + SYNTHETIC_CHUNK)
            yield Chunk("synthetic", 0, label, start, (src["seed"], start, stop, src["max_length"]))
    else:
        yield from iter_chunks([Path(f["path"]) for f in src["files"]], FILE_CHUNK)


def _num_records(sources: dict) -> int | None:
    """Records the tokenize bar will count: the synthetic set's size, Parquet's row counts (its footer) and
    JSONL's lines (one read at memory speed, ~1 s per GB); None where a file cannot be read (its error comes
    from the reader, with its line)."""
    if sources["kind"] == "synthetic":
        return sources["num_samples"]
    total = 0
    try:
        for entry in sources["files"]:
            path = Path(entry["path"])
            if SUFFIXES.get(path.suffix) in ("parquet", "arrow"):
                total += num_rows(path)
                continue
            with open(path, "rb") as f:
                last = b"\n"
                for block in iter(lambda: f.read(1 << 24), b""):
                    total += block.count(b"\n")
                    last = block[-1:]
                total += last != b"\n"  # a last line without its newline
    except Exception:  # noqa: BLE001 - pyarrow raises several types; the reader reports the file properly
        return None
    return total


def _tokenizer_path(name: str) -> str:
    """What train and verify set data.tokenizer to by default: 'byte', or the absolute tokenizer folder."""
    return name if name == "byte" or not Path(name).exists() else str(Path(name).resolve())


def build_store(cfg, target: Path, inputs: dict, tokenizer, *, progress: bool = True) -> TokenStore:
    """Tokenize into a temporary directory beside ``target`` and rename it into place."""
    total = _num_records(inputs["sources"])
    num_workers = default_num_workers(cfg.data.tokenize_workers, tokenizer)
    if cfg.data.tokenize_workers == 0 and total is not None:  # auto: no more workers than chunks (a small input
        chunk = SYNTHETIC_CHUNK if inputs["sources"]["kind"] == "synthetic" else FILE_CHUNK  # tokenizes here,
        num_workers = max(1, min(num_workers, -(-total // chunk)))  # with no pool to fork and feed)
    start, start_cpu = time.perf_counter(), time.process_time()
    with atomic_directory(target, replace=True) as tmp:
        results = tokenize_stream(_chunks(cfg, inputs), tokenizer=cfg.data.tokenizer, schema=_file_schemas(cfg, inputs),
                                  answer_only_loss=cfg.data.answer_only_loss, num_workers=num_workers,
                                  chat_template=cfg.data.chat_template, on_bad_record=cfg.data.on_bad_record,
                                  image_root=cfg.data.image_root)
        counts = write_store(tmp, results, token_dtype=token_dtype_for(tokenizer.vocab_size), total=total,
                             progress=progress, images="image_processor" in inputs)
        image_counts = counts.pop("image_counts", None)
        counts["bad_records"] = {"policy": cfg.data.on_bad_record, **counts["bad_records"]}
        if counts["num_samples"] == 0:
            skipped = counts["bad_records"]["num_skipped"]
            raise DataError(f"data.input ({cfg.data.input}) holds no records"
                            + (f" but the {skipped} bad one(s) skipped ({counts['bad_records']['by_reason']})"
                               if skipped else "") + "; nothing to prepare.")
        meta = {**inputs, **counts, **store_statistics(tmp), "format": STORE_FORMAT,
                "fingerprint": fingerprint(inputs), "tokenizer_path": _tokenizer_path(cfg.data.tokenizer),
                "vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id,
                "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id,
                "token_dtype": np.dtype(token_dtype_for(tokenizer.vocab_size)).name,
                "num_tokenize_workers": num_workers, "tokenize_seconds": round(time.perf_counter() - start, 3),
                "tokenize_cpu_seconds": round(time.process_time() - start_cpu, 3),
                "files": {f"{n}.npy": {"sha256": sha256_file(tmp / f"{n}.npy"), "size": (tmp / f"{n}.npy").stat().st_size}
                          for n in STORE_ARRAYS + (IMAGE_ARRAYS if image_counts else ())}}
        if image_counts:
            meta["images"] = {**image_counts, **inputs["image_processor"], "arrays": list(IMAGE_ARRAYS)}
        write_json(tmp / "metadata.json", meta)
    return TokenStore(target, meta)


def ensure_store(cfg, *, progress: bool = True) -> TokenStore:
    """The token store at data.dataset_dir, built (or rebuilt, when its inputs changed) if needed."""
    target = Path(cfg.data.dataset_dir)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    if cfg.model.pretrained:  # a model built from model.* grows to the tokenizer when train reads the dataset
        problems = tokenizer_vocab_problems(cfg, tokenizer.vocab_size, f"len(tokenizer) = {tokenizer.vocab_size}")
        if problems:
            raise ConfigError(problems)
    inputs = store_inputs(cfg, tokenizer)
    if (target / "metadata.json").is_file():
        old = read_json(target / "metadata.json")
        if old.get("fingerprint") == fingerprint(inputs) and old.get("format_version") == STORE_FORMAT_VERSION:
            try:
                return TokenStore(target, read_metadata(target, STORE_FORMAT, STORE_FORMAT_VERSION))
            except DataError as exc:
                log.warning("rebuilding the token store: %s", exc)
        else:
            changed = store_differences(old, inputs)
            if changed and not cfg.data.overwrite:
                raise DataError(f"data.dataset_dir ({target}) holds a token store built from other inputs "
                                f"({'; '.join(changed)}); set data.overwrite=true to replace it and all its plans, "
                                "or choose another data.dataset_dir.")
            log.warning("data.dataset_dir %s holds a token store built from other inputs (%s); replacing it and its "
                        "plans.", target, "; ".join(changed) or "an older store format")
    return build_store(cfg, target, inputs, tokenizer, progress=progress)


def _sources_text(sources: dict) -> str:
    if sources.get("kind") == "synthetic":
        return f"the synthetic set ({sources.get('num_samples')} samples, seed {sources.get('seed')})"
    return ", ".join(Path(f["path"]).name for f in sources.get("files", [])) or "no files"


def store_differences(old: dict, inputs: dict) -> list[str]:
    """What differs between a store's recorded inputs ``old`` and ``inputs`` (``store_inputs``), one phrase each:
    ``["data: the synthetic set (64 samples, seed 0) -> chat.jsonl"]``; empty when only the store format differs."""
    keys = ("sources", "tokenizer", "answer_only_loss", "schema", "on_bad_record")
    before = fingerprint({k: old[k] for k in keys if k in old} | {"sources": old.get("sources", {"files": []})})
    if before == fingerprint({k: inputs[k] for k in keys if k in inputs}):
        return []
    out = []
    if fingerprint({"sources": old.get("sources", {})}) != fingerprint({"sources": inputs["sources"]}):
        out.append(f"data: {_sources_text(old.get('sources', {}))} -> {_sources_text(inputs['sources'])}")
    if json.dumps(old.get("tokenizer"), sort_keys=True) != json.dumps(inputs["tokenizer"], sort_keys=True):
        out.append(f"data.tokenizer / data.chat_template: {(old.get('tokenizer') or {}).get('name')} -> "
                   f"{inputs['tokenizer'].get('name')}")
    for key, name in (("schema", "the schema keys"), ("answer_only_loss", "data.answer_only_loss"),
                      ("on_bad_record", "data.on_bad_record")):
        if json.dumps(old.get(key), sort_keys=True) != json.dumps(inputs.get(key), sort_keys=True):
            out.append(f"{name}: {old.get(key)} -> {inputs.get(key)}")
    return out or ["the store's inputs"]


def ensure_plan(store: TokenStore, settings: PlanSettings, manifest: dict) -> Path:
    """The plan directory for ``settings`` (recording ``manifest``), written unless an intact one exists."""
    plan_dir = store.path / "plans" / dirname(manifest, store.metadata["fingerprint"])
    if (plan_dir / "metadata.json").is_file():
        try:
            problems = integrity_problems(plan_dir, read_metadata(plan_dir, PLAN_FORMAT, PLAN_FORMAT_VERSION))
            if not problems:
                return plan_dir
            log.warning("rewriting the packing plan %s: %s", plan_dir, "; ".join(problems))
        except DataError as exc:
            log.warning("rewriting the packing plan: %s", exc)
    return write_plan(store, settings, manifest)


def validation_config(cfg):
    """``cfg`` for preparing ``data.validation``: the same tokenizer, template, schema, pack size and pad
    multiple, read from ``data.validation`` into ``<data.dataset_dir>/validation`` (one file: no data.sources)."""
    import dataclasses

    data = dataclasses.replace(cfg.data, source="files", input=cfg.data.validation, validation=None, sources=[],
                               dataset_dir=str(Path(cfg.data.dataset_dir) / VALIDATION_DIRNAME))
    return dataclasses.replace(cfg, data=data)


def _prepare_here(cfg, *, progress: bool) -> Path:
    from megatron_pack.data.packing.report import write_report

    settings, manifest = plan_settings(cfg), build_manifest(cfg)
    store = ensure_store(cfg, progress=progress)  # first: a rebuilt store replaces data.dataset_dir whole
    if cfg.data.validation is not None:  # its own store and plan with the training plan's settings
        valid_cfg = validation_config(cfg)
        valid_plan = ensure_plan(ensure_store(valid_cfg, progress=progress), plan_settings(valid_cfg),
                                 build_manifest(valid_cfg))
        manifest["data.validation"]["plan"] = str(valid_plan.relative_to(Path(cfg.data.dataset_dir)))
    plan_dir = ensure_plan(store, settings, manifest)
    _warn_lost(store, plan_dir)
    if not (plan_dir / "report.json").is_file() or not (plan_dir / "report.png").is_file():
        write_report(store, plan_dir)  # both: a run killed between the two files must not leave one
    if cfg.packing.export == "bridge":
        from megatron_pack.data.packing.bridge import export_bridge

        export_bridge(store, plan_dir)
    return plan_dir


def _warn_lost(store: TokenStore, plan_dir: Path) -> None:
    """One warning line when the overflow policy lost more than 5% of the plan's answer targets."""
    from megatron_pack.data.packing.report import plan_lost_warning

    warning = plan_lost_warning(store.metadata, read_json(plan_dir / "metadata.json"))
    if warning:
        log.warning(warning)


def prepare(cfg, *, rank: int = 0, world_size: int = 1, barrier: Optional[Callable[[], None]] = None,
            verify_timeout_s: float = 300.0, progress: bool = True) -> Path:
    """Tokenize and plan per ``cfg``; return the plan directory. Idempotent.

    With ``world_size > 1`` rank 0 prepares while the others wait at ``barrier`` (it is called
    once on every rank, by rank 0 after it finished or failed), then verify the files, retrying
    until ``verify_timeout_s`` for slow shared filesystems.
    """
    if world_size > 1 and barrier is None:
        raise ValueError("prepare(world_size > 1) needs a barrier callable (e.g. torch.distributed.barrier).")
    marker = _failure_marker(cfg)
    if rank == 0:
        marker.unlink(missing_ok=True)
        try:
            return _prepare_here(cfg, progress=progress)
        except Exception as exc:
            if world_size > 1:  # tell the waiting ranks at once instead of letting them time out
                marker.parent.mkdir(parents=True, exist_ok=True)
                write_json(marker, {"error": f"{type(exc).__name__}: {exc}"})
            raise
        finally:
            if world_size > 1:
                barrier()
    barrier()
    return _wait_for_plan(cfg, verify_timeout_s)


def _failure_marker(cfg) -> Path:
    """Where rank 0 leaves its error for the other ranks: a hidden file beside data.dataset_dir."""
    target = Path(cfg.data.dataset_dir)
    return target.parent / f".{target.name}.prepare-error.json"


def _wait_for_plan(cfg, timeout_s: float) -> Path:
    """On ranks other than 0: the plan rank 0 wrote, verified; retried while the filesystem catches up."""
    deadline = time.monotonic() + timeout_s
    manifest = build_manifest(cfg)
    dataset_dir = Path(cfg.data.dataset_dir)
    while True:
        marker = _failure_marker(cfg)
        if marker.is_file():
            raise DataError(f"rank 0 failed to prepare {dataset_dir}: {read_json(marker)['error']}")
        try:
            store_meta = read_metadata(dataset_dir, STORE_FORMAT, STORE_FORMAT_VERSION)
            plan_dir = dataset_dir / "plans" / dirname(manifest, store_meta["fingerprint"])
            problems = integrity_problems(plan_dir, read_metadata(plan_dir, PLAN_FORMAT, PLAN_FORMAT_VERSION))
            if problems:
                raise DataError(f"{plan_dir} is damaged: {'; '.join(problems)}")
            return plan_dir
        except (DataError, OSError, ValueError) as exc:
            if time.monotonic() > deadline:
                raise DataError(f"rank 0 did not leave a complete, verified dataset at {dataset_dir} within "
                                f"{timeout_s:.0f} s ({exc}); check rank 0's log for its error, or run "
                                "`megatron-pack prepare` once before launching the job.") from exc
            time.sleep(min(2.0, max(0.05, timeout_s / 100)))

