"""What ``prepare`` recorded in a dataset folder, turned into the config train, verify and export run with.

``train``, ``verify`` and ``export`` read a prepared dataset; every plan in it carries a manifest of the
settings that shaped it (``megatron_pack.data.store.manifest``), so the user repeats none of them.

The plan (``choose_plan``): ``data.plan`` names one; otherwise the plans whose manifest agrees with every
key the command line sets, and whose pad multiple (and, with ``model.fp8``, pack multiple) suits the parallel
layout. One left is used (of plans that differ only by the FP8 recipe they were padded for, the one padded
as this run needs); none, or several, is an error naming the plans with the keys that tell them apart. A key the command line does not
set never rejects a plan, and a plan is called damaged only when a checksum fails (its arrays', or its
manifest's against the fingerprint in its name).

The config (``apply_recorded``): every manifest row the command line leaves unset takes the recorded value
(pack size and model.seq_length, pad multiple, algorithm, seed, overflow policy and overlap, buckets,
wrapped attention, data.sources, the validation split or file, tokenizer, chat template, schema keys), and
``model.vocab_size`` grows to the tokenizer's vocabulary, rounded up to a multiple of 128 * TP, when the
config's is smaller (a pretrained folder's only with ``model.resize_vocab``: ``_vocab_setting``). Each value
taken is listed in ``Recorded.notes``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from megatron_pack.config.layout import pack_multiple, pad_multiple, round_up
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.store import manifest as manifests
from megatron_pack.data.store.atomic import read_json
from megatron_pack.data.store.metadata import PLAN_FORMAT, PLAN_FORMAT_VERSION, list_plans, read_metadata

VOCAB_MULTIPLE = 128
"""Recorded vocabularies are padded to a multiple of this times TP (Megatron-LM's make-vocab-size-divisible-by)."""


@dataclass
class Recorded:
    """The config completed from the dataset, and a line for each value it took."""

    cfg: Any
    notes: list[str] = field(default_factory=list)
    check_tokenizer: bool = True
    """False when data.tokenizer came from the dataset (it is the dataset's by construction)."""


def given_keys(overrides: Iterable[str]) -> set[str]:
    """Dotted keys set on the command line: ``["+train.lr=1", "data=files"] -> {"train.lr", "data"}``."""
    return {o.partition("=")[0].lstrip("+~") for o in overrides if "=" in o}


def _plans(dataset_dir: Path) -> tuple[list[tuple[Path, dict]], list[Path]]:
    """``([(plan, metadata)], [plans of another format])``; checksums are verified once one is chosen."""
    plans, other = [], []
    for plan_dir in list_plans(dataset_dir):
        try:
            meta = read_json(plan_dir / "metadata.json")
        except (OSError, ValueError) as exc:  # listed beside the others; alone, its damage is the refusal
            meta = {"_unreadable": exc}
        if meta.get("format_version") == PLAN_FORMAT_VERSION and isinstance(meta.get("manifest"), dict):
            plans.append((plan_dir, meta))
        elif meta.get("format") == PLAN_FORMAT and isinstance(meta.get("format_version"), int) \
                and meta["format_version"] < PLAN_FORMAT_VERSION:
            other.append(plan_dir)
        else:  # an unreadable or future plan: opening it names the problem
            plans.append((plan_dir, meta))
    return plans, other


def _rerun(cfg, dataset_dir: Path, required: int, plans: Iterable[dict] = ()) -> str:
    """The prepare that makes a plan for this layout: at the pack size of the plans there (when they share one;
    the command line's pack size was compared already), rounded up to the pad multiple."""
    par = cfg.parallel
    sizes = {int(m["pack_size"]) for m in plans if m.get("pack_size")}
    size = sizes.pop() if len(sizes) == 1 else cfg.packing.packed_sequence_size
    size = -(-size // required) * required
    layout = f" parallel.context_parallel_size={par.context_parallel_size}" if par.context_parallel_size > 1 else ""
    if par.sequence_parallel and par.tensor_model_parallel_size > 1:
        layout += f" parallel.tensor_model_parallel_size={par.tensor_model_parallel_size} parallel.sequence_parallel=true"
    if cfg.model.fp8 != "none":
        layout += f" model.fp8={cfg.model.fp8}"
    return (f"`megatron-pack prepare data.dataset_dir={dataset_dir} packing.packed_sequence_size="
            f"{size}{layout}` (pads to {required}) with your data settings")


def _values(manifest: dict, entries: Iterable[manifests.Entry]) -> str:
    return ", ".join(e.text(manifest.get(e.key)) for e in entries)


def _given_values(cfg, entries: Iterable[manifests.Entry], given: set[str]) -> str:
    texts = []
    for e in entries:
        key = e.key if e.key in given else next(k for k in e.given_by if k in given)
        group, name = key.split(".")
        texts.append(f"{key}={manifests.override_value(getattr(getattr(cfg, group), name))}")
    return ", ".join(texts)


def choose_plan(cfg, dataset_dir: Path, given: set[str]) -> Path:
    """The plan directory train/verify/export use (module docstring), checked intact; DataError naming the fix."""
    store_fingerprint = read_json(dataset_dir / "metadata.json").get("fingerprint", "")
    plans, older = _plans(dataset_dir)
    older_text = (f" ({', '.join(p.name for p in older)} {'was' if len(older) == 1 else 'were'} written by an "
                  "older megatron_pack, without a manifest: re-run `megatron-pack prepare` to replace "
                  f"{'it' if len(older) == 1 else 'them'})") if older else ""
    par = cfg.parallel
    required = pad_multiple(par.context_parallel_size, par.tensor_model_parallel_size, par.sequence_parallel)
    if not plans:
        raise DataError(f"data.dataset_dir ({dataset_dir}) holds a token store but no packing plan{older_text}; "
                        f"run {_rerun(cfg, dataset_dir, required)}.")
    readable = [m for _, m in plans if "_unreadable" not in m]
    if not readable and isinstance(plans[0][1]["_unreadable"], DataError):  # `<plan>/metadata.json is damaged (...)`
        raise plans[0][1]["_unreadable"]
    if cfg.data.plan is not None:
        plan_dir, meta = _named(cfg, dataset_dir, plans, given)
    else:
        plan_dir, meta = _select(cfg, dataset_dir, plans, given, required, older_text)
    check_intact(plan_dir, store_fingerprint)
    return plan_dir


def _named(cfg, dataset_dir: Path, plans: list[tuple[Path, dict]], given: set[str]) -> tuple[Path, dict]:
    chosen = [(p, m) for p, m in plans if p.name == cfg.data.plan or p == Path(cfg.data.plan)]
    if not chosen:
        names = ", ".join(p.name for p, _ in plans)
        raise DataError(f"data.plan ({cfg.data.plan}) is not a plan in {dataset_dir}/plans; plans there: {names}.")
    plan_dir, meta = chosen[0]
    off = manifests.disagreements(cfg, meta.get("manifest") or {}, given) if "manifest" in meta else []
    if off:
        raise DataError(f"data.plan={plan_dir.name} was made with {_values(meta['manifest'], off)}, but the command "
                        f"line sets {_given_values(cfg, off, given)}; drop those keys (train takes them from the "
                        "plan) or name another plan.")
    return plan_dir, meta


def _select(cfg, dataset_dir: Path, plans: list[tuple[Path, dict]], given: set[str], required: int,
            older_text: str) -> tuple[Path, dict]:
    off = {p: manifests.disagreements(cfg, m["manifest"], given) if "manifest" in m else [] for p, m in plans}
    agree = [(p, m) for p, m in plans if not off[p]]
    if not agree:  # name the keys that rule plans out, and what each plan has for them
        compared = [e for e in manifests.ENTRIES if any(e in found for found in off.values())]
        have = "; ".join(f"{p.name}: {_values(m.get('manifest') or {}, compared)}" for p, m in plans)
        raise DataError(f"no plan in {dataset_dir} was made with {_given_values(cfg, compared, given)} (plans there: "
                        f"{have}){older_text}; drop those keys to use a plan that is there, or run "
                        f"{_rerun(cfg, dataset_dir, required)}.")
    fits = [(p, m) for p, m in agree if int(m.get("pad_seq_to_mult", 1)) % required == 0]
    if not fits:
        pads = sorted({int(m.get("pad_seq_to_mult", 1)) for _, m in agree})
        raise DataError(f"the plans in {dataset_dir} ({', '.join(p.name for p, _ in agree)}) pad each sample to "
                        f"{' or '.join(map(str, pads))} tokens, but this parallel layout (cp={cfg.parallel.context_parallel_size}, "
                        f"tp={cfg.parallel.tensor_model_parallel_size}) needs a multiple of {required}; run "
                        f"{_rerun(cfg, dataset_dir, required, [m for _, m in agree])}.")
    fits = _fitting_pack_multiple(cfg, dataset_dir, fits)
    if len(fits) == 1:
        return fits[0]
    apart = manifests.distinguishing([m.get("manifest") or {} for _, m in fits])
    if [e.key for e in apart] == ["model.fp8"]:  # the same plan padded for several FP8 recipes: the least padding
        tight = [(p, m) for p, m in fits if len(set(_pack_multiples(cfg, m))) == 1]  # made == needed
        if len(tight) == 1:
            return tight[0]
    listed = "; ".join(f"{p.name} ({_values(m.get('manifest') or {}, apart)})" for p, m in fits)
    keys = ", ".join(e.key for e in apart)
    raise DataError(f"{dataset_dir} holds {len(fits)} plans that fit this command: {listed}. The keys that tell them "
                    f"apart: {keys}; set one on the command line, or name the plan with data.plan=<name> "
                    f"(e.g. data.plan={fits[0][0].name}); `megatron-pack inspect {dataset_dir}` compares them.")


def _pack_multiples(cfg, meta: dict) -> tuple[int, int]:
    """(the multiple a plan's packs are padded to, the one ``model.fp8`` needs with this layout and its pad
    multiple: ``config.layout.pack_multiple``); a plan without the record pads only to its pad multiple."""
    par, pad = cfg.parallel, int(meta.get("pad_seq_to_mult", 1))
    needed = pack_multiple(par.context_parallel_size, par.tensor_model_parallel_size, par.sequence_parallel,
                           cfg.model.fp8, pad)
    return int(meta.get("pack_multiple", pad)), needed


def _fitting_pack_multiple(cfg, dataset_dir: Path, plans: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """The plans whose packs are padded to a multiple of what ``model.fp8`` needs with this layout (every
    rank's rows in whole FP8 blocks), whatever the command line gives: a layout rule, as the pad multiple."""
    if cfg.model.fp8 == "none":
        return plans
    multiples = {p: _pack_multiples(cfg, m) for p, m in plans}
    fits = [(p, m) for p, m in plans if multiples[p][0] % multiples[p][1] == 0]
    if not fits:
        made = sorted({made for made, _ in multiples.values()})
        need = max(needed for _, needed in multiples.values())
        raise DataError(f"the plans in {dataset_dir} ({', '.join(p.name for p, _ in plans)}) pad packs to a multiple of "
                        f"{' or '.join(map(str, made))} tokens, but model.fp8={cfg.model.fp8} with "
                        f"cp={cfg.parallel.context_parallel_size} needs {need} (every rank's rows in whole FP8 blocks); "
                        f"run {_rerun(cfg, dataset_dir, need)}.")
    return fits


def check_intact(plan_dir: Path, store_fingerprint: str) -> dict:
    """The plan's metadata, its checksums verified: the arrays' sha256 and the manifest's fingerprint."""
    meta = read_metadata(plan_dir, PLAN_FORMAT, PLAN_FORMAT_VERSION)  # format and array checksums
    if meta.get("store_fingerprint") != store_fingerprint:
        raise DataError(f"plan {plan_dir} was made for another token store; re-run `megatron-pack prepare`.")
    problems = manifests.integrity_problems(plan_dir, meta)
    if problems:
        raise DataError(f"plan {plan_dir} is damaged: {'; '.join(problems)}. Delete it and re-run "
                        f"`megatron-pack prepare data.dataset_dir={plan_dir.parent.parent} ...`.")
    return meta


def apply_recorded(cfg, plan_meta: dict[str, Any], store_meta: dict[str, Any], given: set[str]) -> Recorded:
    """``cfg`` with every recorded setting the command line leaves unset (module docstring)."""
    manifest = plan_meta.get("manifest")
    settings = manifests.settings_from(manifest, given) if manifest is not None else _store_settings(store_meta, given)
    settings.update(_vocab_setting(cfg, store_meta.get("vocab_size"), given))
    return _with_settings(cfg, settings, check_tokenizer="data.tokenizer" in given)


def _vocab_setting(cfg, vocab: Optional[int], given: set[str]) -> dict[str, int]:
    """model.vocab_size for a tokenizer of ``vocab`` ids larger than the model: a model built from ``model.*``
    grows to it (rounded up to 128 * TP); a pretrained folder's vocabulary is its config.json's and grows only with
    ``model.resize_vocab`` (to exactly ``vocab``: the builder pads to TP, the export keeps ``vocab``). Otherwise
    nothing, and ``config.validate.tokenizer_vocab_problems`` refuses the run naming both sizes."""
    if vocab is None or vocab <= cfg.model.vocab_size or "model.vocab_size" in given:
        return {}
    if cfg.model.pretrained:
        return {"model.vocab_size": int(vocab)} if cfg.model.resize_vocab else {}
    return {"model.vocab_size": round_up(int(vocab), VOCAB_MULTIPLE * cfg.parallel.tensor_model_parallel_size)}


SOURCE_KEYS = ("data.source", "data.input", "data.sources", "data.synthetic_num_samples", "data.synthetic_seed")
"""What the token store was read from: one of them given names new inputs, so none is taken from the folder."""


def apply_recorded_to_prepare(cfg, dataset_dir: Path, given: set[str]) -> Recorded:
    """``prepare`` into a folder that holds a dataset: ``cfg`` with every recorded row the command line leaves
    unset (choosing the data preset, ``data=files``, sets the source keys), so a command that names only what is new
    (``packing.packed_sequence_size=1024``) adds a plan to the same token store. The store's rows come from
    the newest plan; a plan row only when every plan records the same value; never the pad multiple (the
    layout's) nor ``model.fp8``. A folder without plans gives nothing."""
    plans = sorted((p for p in _plans(dataset_dir)[0] if isinstance(p[1].get("manifest"), dict)),
                   key=lambda p: (p[0] / "metadata.json").stat().st_mtime)
    if not plans:
        return Recorded(cfg)
    manifests_all = [m["manifest"] for _, m in plans]
    newest = manifests_all[-1]
    if "data" in given or set(given) & set(SOURCE_KEYS):
        given = set(given) | set(SOURCE_KEYS)
    settings: dict[str, Any] = {}
    for entry in manifests.ENTRIES:
        if entry.is_given(given) or entry.key == "packing.pad_seq_to_mult" or entry.key not in newest:
            continue
        if entry.plan and any(not manifests.same(m.get(entry.key), newest[entry.key]) for m in manifests_all):
            continue
        settings.update(entry.settings(newest[entry.key], newest))
    return _with_settings(cfg, {k: v for k, v in settings.items() if k not in given}, check_tokenizer=True)


def _with_settings(cfg, settings: dict[str, Any], *, check_tokenizer: bool) -> Recorded:
    """``cfg`` with ``settings`` and a note for each value that changed."""
    changes: dict[str, dict[str, Any]] = {}
    notes = []
    for key, value in settings.items():
        group, name = key.split(".")
        current = getattr(getattr(cfg, group), name)
        if not manifests.same(current, value):
            changes.setdefault(group, {})[name] = value
            notes.append(f"{key}={manifests.override_value(value)} (was {manifests.override_value(current)})")
    groups = {g: dataclasses.replace(getattr(cfg, g), **c) for g, c in changes.items()}
    return Recorded(dataclasses.replace(cfg, **groups), notes, check_tokenizer=check_tokenizer)


def _store_settings(store_meta: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """Without a plan (in-batch packing): the tokenizer the store was made with."""
    tokenizer = store_meta.get("tokenizer_path") or (store_meta.get("tokenizer") or {}).get("name")
    return {"data.tokenizer": tokenizer} if tokenizer is not None and "data.tokenizer" not in given else {}


def check_input_matches_store(cfg, store_meta: dict[str, Any], dataset_dir: Path) -> Optional[str]:
    """None when ``data.input`` / ``data.sources`` are unset or name the files the store was built from;
    else the problem.

    Training reads only the prepared dataset, so the inputs are optional there; when given they are
    checked by content (sha256, as the store's fingerprint) so a wrong or missing path fails.
    """
    if not cfg.data.input and not cfg.data.sources:
        return None
    from megatron_pack.data.formats.sources import resolve_inputs
    from megatron_pack.data.store.atomic import sha256_file

    key = "data.input" if cfg.data.input else "data.sources"
    given = cfg.data.input or ", ".join(str(s.get("input")) for s in cfg.data.sources)
    drop = f"train and verify read only the prepared dataset: drop {key}, or re-run `megatron-pack prepare`"
    sources = store_meta.get("sources", {})
    if sources.get("kind") != "files":
        return (f"{key} ({given}) is set, but the token store in {dataset_dir} was built from the "
                f"{sources.get('kind', 'unknown')} set; {drop} with {key}.")
    specs = [s.get("input") for s in cfg.data.sources] if cfg.data.sources else [cfg.data.input]
    try:
        current = sorted((i if cfg.data.sources else None, f.name, sha256_file(f))
                         for i, spec in enumerate(specs) for f in resolve_inputs(str(spec)))
    except DataError as exc:
        return f"{exc} ({drop} with {key} pointing at your data)"
    recorded = sorted((f.get("source") if cfg.data.sources else None, Path(f["path"]).name, f.get("sha256"))
                      for f in sources.get("files", []))
    if recorded != current:
        were = ", ".join(name for _, name, _ in recorded)
        return (f"{key} ({given}) holds other files or other contents than the token store in "
                f"{dataset_dir} was built from ({were}); {drop} data.dataset_dir=... with {key}.")
    return None
