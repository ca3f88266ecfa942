"""What ``prepare`` recorded in a dataset folder, turned into the config train and verify run with.

``train`` and ``verify`` read a prepared dataset; the settings it was made with are in its
metadata, so the user does not repeat them. For every key below that the command line does not
set, the recorded value is used (``recorded_overrides``)::

    packing.packed_sequence_size, model.seq_length   <- the plan's pack_size
    packing.pad_seq_to_mult                          <- the plan's pad_seq_to_mult
    packing.algorithm / seed / on_overflow / max_single_sequence_length  <- the plan's
    data.tokenizer                                   <- the store's tokenizer (path, else name)
    model.vocab_size                                 <- the tokenizer's vocabulary, rounded up to
                                                        a multiple of 128 * TP, when the config's is smaller

The plan (``choose_plan``): ``data.plan`` names one; else the plans that agree with the packing
keys given on the command line and whose pad multiple suits the parallel layout; when several
remain, the one the config itself describes; otherwise an error naming them and ``data.plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Optional

from megatron_pack.config.layout import pack_multiple, pad_multiple, round_up
from megatron_pack.data.formats.sources import DataError
from megatron_pack.data.store.atomic import read_json
from megatron_pack.data.store.metadata import (PLAN_FORMAT, PLAN_FORMAT_VERSION, PlanSettings, describe_settings,
                                               list_plans, plan_settings, read_metadata)

PLAN_KEYS = {  # config key -> plan metadata field
    "packing.packed_sequence_size": "pack_size",
    "packing.pad_seq_to_mult": "pad_seq_to_mult",
    "packing.algorithm": "algorithm",
    "packing.seed": "seed",
    "packing.on_overflow": "on_overflow",
    "packing.max_single_sequence_length": "max_single_sequence_length",
}
VOCAB_MULTIPLE = 128
"""Recorded vocabularies are padded to a multiple of this times TP (Megatron-LM's make-vocab-size-divisible-by)."""


@dataclass
class Recorded:
    """The plan chosen and the overrides taken from the dataset, with a line for each."""

    plan_dir: Path
    overrides: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    check_tokenizer: bool = True
    """False when data.tokenizer came from the dataset (it is the dataset's by construction)."""


def given_keys(overrides: Iterable[str]) -> set[str]:
    """Dotted keys set on the command line: ``["+train.lr=1", "data=files"] -> {"train.lr", "data"}``."""
    return {o.partition("=")[0].lstrip("+~") for o in overrides if "=" in o}


def _plan_meta(plan_dir: Path) -> dict:
    try:
        return read_json(plan_dir / "metadata.json")
    except (OSError, ValueError):
        return {}


def _rerun(cfg, dataset_dir: Path, required: int) -> str:
    par = cfg.parallel
    layout = f" parallel.context_parallel_size={par.context_parallel_size}" if par.context_parallel_size > 1 else ""
    if par.sequence_parallel and par.tensor_model_parallel_size > 1:
        layout += f" parallel.tensor_model_parallel_size={par.tensor_model_parallel_size} parallel.sequence_parallel=true"
    if cfg.model.fp8 != "none":
        layout += f" model.fp8={cfg.model.fp8}"
    return (f"`megatron-pack prepare data.dataset_dir={dataset_dir} packing.packed_sequence_size="
            f"{cfg.packing.packed_sequence_size}{layout}` (pads to {required}) with your data settings")


def _check_named_right(plan_dir: Path, meta: dict, cfg, store_fingerprint: str) -> Path:
    """Refuse a plan whose folder name is not the one its own settings give (copied or renamed into
    place): its recorded settings cannot be trusted to be what the name promises."""
    try:
        own = _recorded_settings(meta, plan_settings(cfg))
    except KeyError:
        return plan_dir  # an incomplete metadata.json: opening the plan names what is missing
    if own.dirname(store_fingerprint) == plan_dir.name:
        return plan_dir
    named = plan_settings(cfg)
    stands_for = (f"; the folder name stands for {describe_settings(named)}"
                  if named.dirname(store_fingerprint) == plan_dir.name else "")
    raise DataError(f"plan {plan_dir} holds a plan made with other settings (its metadata.json records "
                    f"{describe_settings(own)}{stands_for}: edited, copied or renamed); delete it and run "
                    f"`megatron-pack prepare data.dataset_dir={plan_dir.parent.parent} ...` with the settings you want.")


def _recorded_settings(meta: dict, from_cfg: PlanSettings) -> PlanSettings:
    """The settings a plan's metadata.json records; what it cannot record (the data.sources weights)
    is taken from the config."""
    buckets = (meta.get("buckets") or {}).get("spec")
    split = meta.get("split") or {}
    return replace(from_cfg, pack_size=meta["pack_size"], pad_multiple=meta["pad_seq_to_mult"],
                   pack_multiple=int(meta.get("pack_multiple", meta["pad_seq_to_mult"])),
                   algorithm=meta["algorithm"], seed=meta["seed"], on_overflow=meta["on_overflow"],
                   max_length=meta["max_single_sequence_length"], split_overlap=meta.get("split_overlap", 0),
                   buckets=buckets if buckets is None or buckets == "auto" else tuple(int(b) for b in buckets),
                   wrapped_attention=meta.get("wrapped_attention", "document"),
                   validation_fraction=float(split.get("validation_fraction", 0.0)),
                   validation_seed=int(split.get("validation_seed", 0)))


def choose_plan(cfg, dataset_dir: Path, given: set[str]) -> Path:
    """The plan directory train/verify use (see the module docstring); DataError naming the fix."""
    store_fingerprint = read_json(dataset_dir / "metadata.json").get("fingerprint", "")
    plan_dir = _choose(cfg, dataset_dir, given, store_fingerprint)
    meta = read_metadata(plan_dir, PLAN_FORMAT, PLAN_FORMAT_VERSION)  # format and checksums first
    return _check_named_right(plan_dir, meta, cfg, store_fingerprint)


def _choose(cfg, dataset_dir: Path, given: set[str], store_fingerprint: str) -> Path:
    plans = list_plans(dataset_dir)
    names = ", ".join(p.name for p in plans) or "none"
    par = cfg.parallel
    required = pad_multiple(par.context_parallel_size, par.tensor_model_parallel_size, par.sequence_parallel)
    if not plans:
        raise DataError(f"data.dataset_dir ({dataset_dir}) holds a token store but no packing plan; run "
                        f"{_rerun(cfg, dataset_dir, required)}.")
    if cfg.data.plan is not None:
        chosen = [p for p in plans if p.name == cfg.data.plan or p == Path(cfg.data.plan)]
        if not chosen:
            raise DataError(f"data.plan ({cfg.data.plan}) is not a plan in {dataset_dir}/plans; plans there: {names}.")
        return chosen[0]
    metas = {p: _plan_meta(p) for p in plans}
    wanted = {PLAN_KEYS[k]: getattr(cfg.packing, k.split(".")[1]) for k in PLAN_KEYS if k in given}
    if "model.seq_length" in given and "packing.packed_sequence_size" not in given:
        wanted["pack_size"] = cfg.model.seq_length
    agree = [p for p in plans if all(metas[p].get(f) == v for f, v in wanted.items())]
    if not agree:
        shown = ", ".join(f"{k}={v}" for k, v in wanted.items())
        raise DataError(f"no plan in {dataset_dir} was made with {shown} (plans there: {names}); drop those "
                        f"overrides to use a plan that is there, or run {_rerun(cfg, dataset_dir, required)}.")
    fits = [p for p in agree if int(metas[p].get("pad_seq_to_mult", 1)) % required == 0]
    if not fits:
        pads = sorted({int(metas[p].get("pad_seq_to_mult", 1)) for p in agree})
        raise DataError(f"the plans in {dataset_dir} ({', '.join(p.name for p in agree)}) pad each sample to "
                        f"{' or '.join(map(str, pads))} tokens, but this parallel layout (cp={par.context_parallel_size}, "
                        f"tp={par.tensor_model_parallel_size}) needs a multiple of {required}; run "
                        f"{_rerun(cfg, dataset_dir, required)}.")
    fits = _fitting_pack_multiple(cfg, dataset_dir, fits, metas)
    if len(fits) == 1:
        return fits[0]
    exact = [p for p in fits if p.name == plan_settings(cfg).dirname(store_fingerprint)]
    if exact:
        return exact[0]
    raise DataError(f"{dataset_dir} holds {len(fits)} plans that fit this config: "
                    f"{', '.join(p.name for p in fits)}; pick one with data.plan=<name> "
                    f"(e.g. data.plan={fits[0].name}); `megatron-pack inspect {dataset_dir}` compares them.")


def _fitting_pack_multiple(cfg, dataset_dir: Path, plans: list[Path], metas: dict[Path, dict]) -> list[Path]:
    """The plans whose packs are padded to a multiple of what ``model.fp8`` needs with this layout
    (``config.layout.pack_multiple``); a plan without the record pads only to its pad multiple."""
    if cfg.model.fp8 == "none":
        return plans
    par = cfg.parallel
    made = {p: int(metas[p].get("pack_multiple", metas[p].get("pad_seq_to_mult", 1))) for p in plans}
    needed = {p: pack_multiple(par.context_parallel_size, par.tensor_model_parallel_size, par.sequence_parallel,
                               cfg.model.fp8, int(metas[p].get("pad_seq_to_mult", 1))) for p in plans}
    fits = [p for p in plans if made[p] % needed[p] == 0]
    if not fits:
        need = max(needed.values())
        raise DataError(f"the plans in {dataset_dir} ({', '.join(p.name for p in plans)}) pad packs to a multiple of "
                        f"{' or '.join(map(str, sorted(set(made.values()))))} tokens, but model.fp8={cfg.model.fp8} with "
                        f"cp={par.context_parallel_size} needs {need} (every rank's rows in whole FP8 blocks); run "
                        f"{_rerun(cfg, dataset_dir, need)}.")
    return fits


def recorded_overrides(cfg, plan_meta: dict[str, Any], store_meta: dict[str, Any], given: set[str]) -> Recorded:
    """``key=value`` overrides for the recorded settings the command line leaves unset (module docstring)."""
    out = Recorded(plan_dir=Path())

    def use(key: str, value: Any, why: str) -> None:
        if key in given or value is None:
            return
        current = _get(cfg, key)
        if current != value:
            out.overrides.append(f"{key}={_yaml(value)}")
            out.notes.append(f"{key}={value} (was {current}; {why})")

    for key, name in PLAN_KEYS.items():
        value = plan_meta.get(name)
        if name == "max_single_sequence_length" and value == plan_meta.get("pack_size"):
            value = None  # the default (None = the pack size): nothing to say
        use(key, value, "recorded in the plan")
    use("model.seq_length", plan_meta.get("pack_size"), "the plan's pack size")
    tokenizer = store_meta.get("tokenizer_path") or (store_meta.get("tokenizer") or {}).get("name")
    if "data.tokenizer" not in given:
        use("data.tokenizer", tokenizer, "the tokenizer the store was made with")
        out.check_tokenizer = False
    vocab = store_meta.get("vocab_size")
    if vocab is not None and vocab > cfg.model.vocab_size:
        padded = round_up(int(vocab), VOCAB_MULTIPLE * cfg.parallel.tensor_model_parallel_size)
        use("model.vocab_size", padded, f"the tokenizer's {vocab} tokens, padded to a multiple of "
            f"{VOCAB_MULTIPLE}*tp")
    return out


def _get(cfg, key: str) -> Any:
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def _yaml(value: Any) -> str:
    """An override value Hydra reads back as ``value`` (paths and names quoted)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def check_input_matches_store(cfg, store_meta: dict[str, Any], dataset_dir: Path) -> Optional[str]:
    """None when ``data.input`` is unset or names the files the store was built from; else the problem.

    Training reads only the prepared dataset, so ``data.input`` is optional there; when given it
    is checked by content (sha256, as the store's fingerprint) so a wrong or missing path fails.
    """
    if not cfg.data.input:
        return None
    from megatron_pack.data.formats.sources import resolve_inputs
    from megatron_pack.data.store.atomic import sha256_file

    drop = "train and verify read only the prepared dataset: drop data.input, or re-run `megatron-pack prepare`"
    sources = store_meta.get("sources", {})
    if sources.get("kind") != "files":
        return (f"data.input ({cfg.data.input}) is set, but the token store in {dataset_dir} was built from the "
                f"{sources.get('kind', 'unknown')} set; {drop} with data.input={cfg.data.input}.")
    try:
        files = resolve_inputs(cfg.data.input)
    except DataError as exc:
        return f"{exc} ({drop} with data.input pointing at your data)"
    recorded = sorted((Path(f["path"]).name, f.get("sha256")) for f in sources.get("files", []))
    current = sorted((f.name, sha256_file(f)) for f in files)
    if recorded != current:
        were = ", ".join(name for name, _ in recorded)
        return (f"data.input ({cfg.data.input}) holds other files or other contents than the token store in "
                f"{dataset_dir} was built from ({were}); {drop} data.dataset_dir=... with data.input={cfg.data.input}.")
    return None
