"""A plan's manifest: every setting that shaped it, by config key, recorded beside it by ``prepare``.

Each plan's ``metadata.json`` holds ``manifest``, one entry per row of ``ENTRIES``::

    "manifest": {"packing.packed_sequence_size": 512, "packing.pad_seq_to_mult": 4, "packing.algorithm": "bfd",
                 "packing.seed": 0, "packing.on_overflow": "split", "packing.split_overlap": 64, ...,
                 "data.sources": [{"name": "chat", "input": "/abs/chat.jsonl", "weight": 0.6, "format": "sharegpt"}],
                 "data.validation": {"input": "/abs/valid.jsonl", "files": [...], "plan": "validation/plans/..."},
                 "data.tokenizer": {"path": "/abs/tokenizer", "vocab_hash": ...},
                 "data.chat_template": {"path": ..., "sha256": ..., "text": ...}}

Rows marked ``plan`` make the plan's identity: its fingerprint is the sha256 of the store's fingerprint and
those rows (the others shaped the token store, whose own fingerprint covers them), and the plan's folder
name ends with it. So a plan is *damaged* exactly when a checksum fails: an array's sha256, or the
manifest's (an edited manifest, or a folder renamed or copied, no longer hashes to its name).

``train``, ``verify``, ``inspect`` and ``export`` read the manifest instead of recomputing it from their
own command line (``megatron_pack.data.store.recorded``):

* a key given on the command line must agree with the row that records it (``Entry.agrees``): that is how
  the plan is picked when a folder holds several;
* a key not given takes the recorded value (``Entry.applies``), so nothing is repeated, and a key the user
  did not type never rejects a plan by its default.

To record a new setting, add one ``Entry`` to ``ENTRIES`` (as ``model.fp8``'s pack multiple was); prepare
records it, the plan's identity and selection follow, and train takes it from the dataset unless its row says not.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_pack.config.layout import effective_pack_multiple, effective_pad_multiple

MANIFEST_VERSION = 2
"""The plan format version that carries a manifest (``megatron_pack.data.store.metadata.PLAN_FORMAT_VERSION``)."""


def _get(cfg, key: str) -> Any:
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def _abs(path: Optional[str]) -> Optional[str]:
    return None if path is None else str(Path(path).resolve())


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One recorded setting: the config key, how a config gives its value, and how train reads it back."""

    key: str
    """The dotted config key recorded (``packing.seed``)."""
    read: Optional[Callable[[Any], Any]] = None
    """The value a config gives, as recorded (JSON-ready); None reads the key as it is."""
    plan: bool = True
    """Part of the plan's identity (hashed into its fingerprint); False: it shaped the token store, whose
    fingerprint covers it."""
    identity: Optional[Callable[[Any], Any]] = None
    """What the fingerprint hashes of the recorded value (without paths); None hashes the value."""
    applies: Optional[Callable[[Any, dict], dict]] = None
    """``{key: value}`` train sets from the recorded value when the command line leaves them unset
    (given the whole manifest); None sets ``{key: recorded}``."""
    agrees: Optional[Callable[[Any, Any, set], bool]] = None
    """Whether a config's value (key given on the command line) agrees with the recorded one, given the
    keys set on the command line; None compares ``read(cfg) == recorded``."""
    given_by: tuple[str, ...] = ()
    """Other keys that, given on the command line, make this row compared (``model.seq_length`` is the pack size)."""
    compared: bool = True
    """False: never compared here (``data.tokenizer`` and ``data.input`` are checked by content where opened,
    ``model.fp8``'s pack multiple against the parallel layout where the plan is chosen)."""
    show: Optional[Callable[[Any], str]] = None
    """The recorded value as messages print it; None writes it as an override value."""
    taken: bool = True
    """False: train never takes the recorded value (``model.fp8``: a model setting the plan was padded for)."""

    def value(self, cfg) -> Any:
        return self.read(cfg) if self.read is not None else _get(cfg, self.key)

    def is_given(self, given: set[str]) -> bool:
        return self.key in given or any(k in given for k in self.given_by)

    def agrees_with(self, cfg, recorded: Any, given: set[str]) -> bool:
        if self.agrees is not None:
            return self.agrees(cfg, recorded, given)
        return same(self.value(cfg), recorded)

    def hashed(self, recorded: Any) -> Any:
        return self.identity(recorded) if self.identity is not None and recorded is not None else recorded

    def settings(self, recorded: Any, manifest: dict) -> dict[str, Any]:
        if not self.taken:
            return {}
        return self.applies(recorded, manifest) if self.applies is not None else {self.key: recorded}

    def text(self, recorded: Any) -> str:
        shown = self.show(recorded) if self.show is not None and recorded is not None else override_value(recorded)
        return f"{self.key}={shown}"


def same(a: Any, b: Any) -> bool:
    """Equal as JSON would store them (tuples are lists, 1 == 1.0 for floats)."""
    return json.loads(json.dumps(a, sort_keys=True)) == json.loads(json.dumps(b, sort_keys=True))


def override_value(value: Any) -> str:
    """A value as a ``key=value`` override writes it: ``null``, ``true``, ``0.2``, ``[16,32]``, ``auto``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {override_value(v)}" for k, v in value.items()) + "}"
    return str(value)


# ----- the rows' readers ---------------------------------------------------------------------------

def _pack_size_agrees(cfg, recorded, given) -> bool:
    # model.seq_length given alone names the pack size too (they are equal with offline packing)
    given_size = "packing.packed_sequence_size" in given
    return (cfg.packing.packed_sequence_size if given_size else cfg.model.seq_length) == recorded


def _max_length(cfg) -> int:
    size = cfg.packing.packed_sequence_size
    return min(cfg.packing.max_single_sequence_length or size, size)


def _buckets(cfg):
    spec = cfg.packing.buckets
    return spec if spec is None or spec == "auto" else [int(b) for b in spec]


def _wrapped_attention(cfg) -> str:
    return cfg.packing.wrapped_attention if cfg.packing.algorithm == "wrapped" else "document"


SOURCE_ENTRY_KEYS = ("name", "input", "weight", "tokens")


def _sources(cfg) -> list[dict]:
    """data.sources as recorded: each entry's keys in a fixed order, its input as an absolute path."""
    from megatron_pack.config.schema import SOURCE_SCHEMA_KEYS

    out = []
    for entry in cfg.data.sources:
        row = {k: entry[k] for k in SOURCE_ENTRY_KEYS + SOURCE_SCHEMA_KEYS if entry.get(k) is not None}
        row["input"] = _abs(entry["input"])
        if "role_aliases" in row:
            row["role_aliases"] = dict(row["role_aliases"])
        out.append(row)
    return out


def _without_inputs(sources: list[dict]) -> list[dict]:
    # the files' contents are the token store's (its fingerprint hashes their sha256); a moved file is the same source
    return [{k: v for k, v in s.items() if k != "input"} for s in sources]


def _sources_agree(cfg, recorded, given) -> bool:
    return same(_without_inputs(_sources(cfg)), _without_inputs(recorded or []))


def _file_hashes(spec: str) -> list[dict]:
    from megatron_pack.data.formats.sources import resolve_inputs
    from megatron_pack.data.store.atomic import sha256_file

    return [{"name": f.name, "sha256": sha256_file(f)} for f in resolve_inputs(spec)]


def _validation(cfg) -> Optional[dict]:
    if cfg.data.validation is None:
        return None
    return {"input": _abs(cfg.data.validation), "files": _file_hashes(cfg.data.validation)}


def _validation_agrees(cfg, recorded, given) -> bool:
    if cfg.data.validation is None or recorded is None:
        return cfg.data.validation is None and recorded is None
    return same(_file_hashes(cfg.data.validation), recorded["files"])


def _tokenizer(cfg) -> dict:
    """The tokenizer folder (absolute) or ``byte``, and the hash of its vocabulary (chat template included)."""
    from megatron_pack.data.formats.tokenizer import build_tokenizer  # built once per process

    name = cfg.data.tokenizer
    path = name if name == "byte" or not Path(name).exists() else str(Path(name).resolve())
    return {"path": path, "vocab_hash": build_tokenizer(name, cfg.data.chat_template).identity()["vocab_hash"]}


def _chat_template(cfg) -> Optional[dict]:
    path = cfg.data.chat_template
    if path is None:
        return None
    from megatron_pack.data.formats.chat import read_chat_template

    text = read_chat_template(path)
    return {"path": _abs(path), "sha256": text_sha256(text), "text": text}


def _template_agrees(cfg, recorded, given) -> bool:
    mine = _chat_template(cfg)
    return (mine is None and recorded is None) or (mine is not None and recorded is not None
                                                   and mine["sha256"] == recorded["sha256"])


def _fp8(cfg) -> dict:
    """The FP8 recipe and the multiple every pack's token count is padded to (``config.layout.pack_multiple``
    for the layout; the pad multiple without a recipe): ``{"recipe": "delayed", "pack_multiple": 32}``."""
    return {"recipe": cfg.model.fp8, "pack_multiple": effective_pack_multiple(cfg)}


def _synthetic(name: str) -> Callable[[Any], Any]:
    return lambda cfg: getattr(cfg.data, name) if cfg.data.source == "synthetic" else None


def _if_recorded(key: str) -> Callable[[Any, dict], dict]:
    """Set ``key`` only when the row recorded a value (None: it does not apply to this dataset)."""
    return lambda value, manifest: {} if value is None else {key: value}


def _input(cfg) -> Optional[str]:
    return _abs(cfg.data.input) if cfg.data.source == "files" and not cfg.data.sources else None


SCHEMA_KEYS = ("schema", "format", "prompt_key", "completion_key", "messages_key", "role_key", "content_key",
               "role_aliases")

ENTRIES: tuple[Entry, ...] = (
    # the plan: how the store's samples were selected and laid into packs
    Entry("packing.packed_sequence_size", given_by=("model.seq_length",), agrees=_pack_size_agrees,
          applies=lambda v, m: {"packing.packed_sequence_size": v, "model.seq_length": v}),
    Entry("packing.pad_seq_to_mult", read=effective_pad_multiple),
    Entry("packing.algorithm"),
    Entry("packing.seed"),
    Entry("packing.on_overflow"),
    Entry("packing.max_single_sequence_length", read=_max_length,
          applies=lambda v, m: {"packing.max_single_sequence_length":
                                None if v == m["packing.packed_sequence_size"] else v}),
    Entry("packing.split_overlap"),
    Entry("packing.buckets", read=_buckets),
    Entry("packing.wrapped_attention", read=_wrapped_attention),
    # a plan padded for an FP8 recipe also trains without one: the recipe is never taken from the dataset,
    # and a run's recipe rules a plan out only by its pack multiple (``recorded._fitting_pack_multiple``)
    Entry("model.fp8", read=_fp8, compared=False, taken=False,
          show=lambda v: f"{v['recipe']} (packs padded to a multiple of {v['pack_multiple']})"),
    Entry("data.sources", read=_sources, identity=_without_inputs, agrees=_sources_agree,
          show=lambda v: ",".join(f"{s['name']}:{s.get('weight', s.get('tokens'))}" for s in v) or "[]"),
    Entry("data.validation_fraction", read=lambda cfg: float(cfg.data.validation_fraction)),
    Entry("data.validation_seed"),
    Entry("data.validation", read=_validation, identity=lambda v: v["files"], agrees=_validation_agrees,
          applies=lambda v, m: {"data.validation": v and v["input"]}, show=lambda v: v["input"] if v else "null"),
    # the token store: what was tokenized, and how (its fingerprint covers these)
    Entry("data.source", plan=False),
    Entry("data.input", read=_input, plan=False, compared=False),
    Entry("data.synthetic_num_samples", read=_synthetic("synthetic_num_samples"), plan=False,
          applies=_if_recorded("data.synthetic_num_samples")),
    Entry("data.synthetic_seed", read=_synthetic("synthetic_seed"), plan=False, applies=_if_recorded("data.synthetic_seed")),
    Entry("data.tokenizer", read=_tokenizer, plan=False, compared=False,
          applies=lambda v, m: {"data.tokenizer": v["path"]}, show=lambda v: v["path"]),
    Entry("data.chat_template", read=_chat_template, plan=False, agrees=_template_agrees,
          applies=lambda v, m: {"data.chat_template": v and v["path"]}, show=lambda v: v["path"] if v else "null"),
    Entry("data.answer_only_loss", plan=False),
    Entry("data.on_bad_record", plan=False),
    *(Entry(f"data.{name}", plan=False) for name in SCHEMA_KEYS),
)
"""Every recorded setting, in the order messages list them."""

BY_KEY = {e.key: e for e in ENTRIES}

TOP_LEVEL = {"pack_size": "packing.packed_sequence_size", "pad_seq_to_mult": "packing.pad_seq_to_mult",
             "algorithm": "packing.algorithm", "seed": "packing.seed", "on_overflow": "packing.on_overflow",
             "max_single_sequence_length": "packing.max_single_sequence_length",
             "split_overlap": "packing.split_overlap"}
"""Plan metadata fields (Megatron-Bridge's names and the older ones) copied from the manifest; they must agree."""


def build_manifest(cfg) -> dict[str, Any]:
    """The manifest ``prepare`` records for ``cfg`` (``data.validation``'s plan is added once it is written)."""
    return {e.key: e.value(cfg) for e in ENTRIES}


def fingerprint(manifest: dict[str, Any], store_fingerprint: str) -> str:
    """sha256 of the store's fingerprint and the manifest's plan rows (paths left out)."""
    rows = {e.key: e.hashed(manifest.get(e.key)) for e in ENTRIES if e.plan}
    blob = json.dumps({"store": store_fingerprint, "plan": rows, "format_version": MANIFEST_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def dirname(manifest: dict[str, Any], store_fingerprint: str) -> str:
    """``pack<P>_mult<M>_<algorithm>_seed<S>_<on_overflow>_[val<f>s<seed>_]<fingerprint[:12]>``."""
    m = manifest
    fraction = m.get("data.validation_fraction") or 0.0
    held_out = f"val{fraction:g}s{m.get('data.validation_seed', 0)}_" if fraction else ""
    return (f"pack{m['packing.packed_sequence_size']}_mult{m['packing.pad_seq_to_mult']}_{m['packing.algorithm']}_"
            f"seed{m['packing.seed']}_{m['packing.on_overflow']}_{held_out}{fingerprint(m, store_fingerprint)[:12]}")


def top_level_fields(manifest: dict[str, Any]) -> dict[str, Any]:
    """The plan metadata fields that repeat manifest rows (``TOP_LEVEL``)."""
    return {field: manifest[key] for field, key in TOP_LEVEL.items()}


def integrity_problems(plan_dir: Path, meta: dict) -> list[str]:
    """Why a plan's manifest does not check out (empty when it does): it must hash to the plan's fingerprint,
    the folder name must end with that fingerprint, and the fields that repeat it must agree."""
    manifest = meta.get("manifest")
    if not isinstance(manifest, dict) or any(e.key not in manifest for e in ENTRIES if e.plan):
        return [f"{plan_dir / 'metadata.json'} has no complete manifest"]
    problems = []
    recorded = str(meta.get("fingerprint", ""))
    own = fingerprint(manifest, str(meta.get("store_fingerprint", "")))
    if own != recorded:
        problems.append(f"its manifest hashes to fingerprint {own[:12]}, but the plan records {recorded[:12]} "
                        "(the manifest was edited)")
    elif not Path(plan_dir).name.endswith(recorded[:12]):
        problems.append(f"its fingerprint {recorded[:12]} is not the one its folder name ends with "
                        "(the folder was renamed, or another plan copied into it)")
    for field, value in top_level_fields(manifest).items():
        if field in meta and not same(meta[field], value):
            problems.append(f"metadata field {field} ({meta[field]}) differs from its manifest ({value})")
    return problems


def given_entries(given: set[str]) -> list[Entry]:
    """The rows a command line sets (compared with every plan)."""
    return [e for e in ENTRIES if e.compared and e.is_given(given)]


def disagreements(cfg, manifest: dict[str, Any], given: set[str]) -> list[Entry]:
    """The rows the command line sets (``given``) whose value in ``cfg`` differs from ``manifest``'s."""
    return [e for e in given_entries(given) if not e.agrees_with(cfg, manifest.get(e.key), given)]


def settings_from(manifest: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """``{config key: recorded value}`` for every key the command line leaves unset."""
    out: dict[str, Any] = {}
    for entry in ENTRIES:
        if entry.key not in manifest:
            continue
        for key, value in entry.settings(manifest[entry.key], manifest).items():
            if key not in given:
                out[key] = value
    return out


def distinguishing(manifests: list[dict[str, Any]]) -> list[Entry]:
    """The rows whose recorded values differ between the plans of ``manifests`` (what tells them apart)."""
    return [e for e in ENTRIES if len({json.dumps(m.get(e.key), sort_keys=True) for m in manifests}) > 1]
