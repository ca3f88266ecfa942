"""Compose the preset YAML with Hydra, convert once to the dataclasses, validate.

The shipped presets are ``configs/`` at the top of the repository (package data of a wheel); user
folders are searched after them (``megatron_pack.config.search_path``). The structured schema (``Config``) is
registered in Hydra's ConfigStore as ``base_config`` and is the first entry of
``configs/config.yaml``'s defaults list, so every YAML key and every
override is type-checked against the dataclasses. Overrides are checked against the schema
and the available presets before Hydra runs, so a typo fails at once with a suggestion::

    >>> load_config(["packing.packed_sequnce_size=8"])
    ConfigError: 1 config problem(s):
      - packing.packed_sequnce_size=8: unknown key 'packing.packed_sequnce_size'; did you mean
        'packing.packed_sequence_size'?
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from megatron_pack.config.choices import PACKING_MODES
from megatron_pack.config.hf_config import apply_pretrained
from megatron_pack.config.foreign_names import foreign_name
from megatron_pack.config.schema import GROUPS, Config, ConfigError
from megatron_pack.config.search_path import (CONFIG_DIR_ENV, PRESETS_DIR, experiment_files, presets,  # noqa: F401
                                              shadow_problems, user_config_dirs)
from megatron_pack.config.validate import validate

_SCHEMA_NAME = "base_config"
_registered = False


def config_dir() -> Path:
    """The shipped presets folder (``configs/`` of the repository, or a wheel's copy of it), the first on the
    search path."""
    return PRESETS_DIR


def _unfreeze(node: DictConfig) -> None:
    """Clear the read-only flag OmegaConf derives from frozen dataclasses, so YAML can merge in.

    The dataclasses are frozen so the loaded ``Config`` is read-only; OmegaConf would otherwise
    also lock the schema node and refuse every override.
    """
    OmegaConf.set_readonly(node, None)  # only container nodes carry the flag
    for key in node.keys():
        child = node[key]
        if isinstance(child, DictConfig):
            _unfreeze(child)


def register_schema() -> None:
    """Store the structured ``Config`` in Hydra's ConfigStore (once per process)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    schema = OmegaConf.structured(Config)
    _unfreeze(schema)
    OmegaConf.set_struct(schema.data.role_aliases, False)  # a user mapping: its keys are the user's role names
    OmegaConf.set_struct(schema.data.sources, False)  # entries are user mappings, checked by DataConfig
    schema.train.min_lr = None  # unset unless YAML or an override sets it: TrainConfig derives it from train.lr

    ConfigStore.instance().store(name=_SCHEMA_NAME, node=schema)
    _registered = True


def _all_keys() -> list[str]:
    return [f"{group}.{f.name}" for group, cls in GROUPS.items() for f in dataclasses.fields(cls)]


def _did_you_mean(word: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


RETIRED_KEYS = {"packing.in_batch": ("packing.mode", {True: "in_batch", False: "offline", None: "in_batch"})}
"""Keys of earlier releases -> the key that replaced them and its value for each old value (None: unknown)."""


def retired_key(key: str, value: Any = None) -> Optional[str]:
    """How to write a retired ``key`` (set to ``value``) now, or None when ``key`` is not retired.

    >>> retired_key("packing.in_batch", True)
    "did you mean 'packing.mode=in_batch'? packing.in_batch was replaced by packing.mode (offline | online | in_batch), the one packing switch."
    """
    if key not in RETIRED_KEYS:
        return None
    new, values = RETIRED_KEYS[key]
    spelled = values.get(value if isinstance(value, bool) else None, values[None])
    return (f"did you mean '{new}={spelled}'? {key} was replaced by {new} ({' | '.join(PACKING_MODES)}), "
            "the one packing switch.")


def suggest_key(key: str, keys: list[str], groups: list[str]) -> Optional[str]:
    """The key a mistyped ``key`` most likely meant, or None.

    Tried in order: a name from another tool (``config.foreign_names``: ``train.learning_rate`` -> ``train.lr``);
    for a bare word a close group name (``paralel`` -> ``parallel``) or a field of any group
    (``num_layers`` -> ``model.num_layers``); for a dotted key a close key of its own group, then
    of any group (``modle.num_layers`` -> ``model.num_layers``), then its last part as a field.
    """
    leaf = key.rsplit(".", 1)[-1]
    known = foreign_name(leaf)
    if known and known.key in keys:
        return known.key
    close = lambda word, options, cutoff: (difflib.get_close_matches(word, options, n=1, cutoff=cutoff) or [None])[0]  # noqa: E731
    by_leaf: dict[str, str] = {}
    for k in keys:
        by_leaf.setdefault(k.split(".", 1)[1], k)
    if "." not in key:  # a group (``paralel=cp2``) or a field without its group (``num_layers=2``)
        found = close(key, groups, 0.75) or close(key, list(by_leaf), 0.8)
        return by_leaf.get(found, found) if found else close(key, keys, 0.6)
    group = key.split(".", 1)[0]
    in_group = [k.split(".", 1)[1] for k in keys if k.startswith(group + ".")]
    # prefer a field of the group the user named (compared without the shared group prefix, which
    # would make ``train.foo`` look like ``train.bf16``) over a close spelling elsewhere
    found = f"{group}.{close(leaf, in_group, 0.6)}" if close(leaf, in_group, 0.6) else None
    found = found or (close(key, keys, 0.6) if group not in GROUPS else None)
    leaf_found = close(leaf, list(by_leaf), 0.8)
    return found or (by_leaf[leaf_found] if leaf_found else None)


def _unknown_key(text: str, key: str, keys: list[str], groups: Optional[list[str]] = None) -> str:
    """The message for an override or YAML key that names no field (never raises, whatever ``key`` is)."""
    if retired_key(key):
        return f"{text}: unknown key '{key}'; {retired_key(key)}"
    groups = sorted(set(groups or []) | set(GROUPS))
    dotted = [k for k in keys if "." in k]
    known = foreign_name(key)
    if known and known.key in dotted:  # the reviewed answer, with how its meaning differs
        return f"{text}: unknown key '{key}'; {known.hint()}"
    best = suggest_key(key, dotted, groups)
    if best:
        return f"{text}: unknown key '{key}'; did you mean '{best}'?"
    group = key.split(".", 1)[0]
    if group in GROUPS:
        return f"{text}: unknown key '{key}'; keys of {group}: {', '.join(f.name for f in dataclasses.fields(GROUPS[group]))}"
    return (f"{text}: unknown key '{key}'; keys are group.key=value with a group among {', '.join(groups)} "
            "(`megatron-pack <command> --help` lists the common ones, docs/configuration.md all of them).")


def _check_selection(text: str, group: str, value: Any, options: dict[str, list[str]]) -> Optional[str]:
    """A ``group=option`` override: the option must name a YAML file ``<group>/<option>.yaml`` on the search path."""
    choices = options[group]
    if value is None or (isinstance(value, str) and value in choices):
        return None
    hint = _did_you_mean(str(value), choices)
    return (f"{text}: no preset '{value}' in {group}/ (shipped presets, {CONFIG_DIR_ENV}, --config-dir){hint} "
            f"Available: {', '.join(choices)}.")


def check_overrides(overrides: list[str], roots: Path | list[Path]) -> list[str]:
    """Problems with override keys, preset names and value types, found before Hydra composes."""
    return list(override_problems(overrides, roots).values())


def override_problems(overrides: list[str], roots: Path | list[Path]) -> dict[str, str]:
    """``{override: its problem}`` for each override refused before Hydra composes (key, preset, value type)."""
    options, keys, problems = presets(roots), _all_keys(), {}
    parsers: dict = {}
    for text in overrides:
        try:
            override = _parse(text, parsers)
        except Exception as exc:  # noqa: BLE001 - Hydra's parse errors are HydraExceptions; others propagate
            if not _is_hydra_error(exc):
                raise
            problems[text] = (f"{text}: not a key=value override ({str(exc).splitlines()[0]}); "
                              "write it as group.key=value, e.g. packing.packed_sequence_size=1024.")
            continue
        problem = _check_override(text, override, options, keys)
        if problem:
            problems[text] = problem
    return problems


def _check_override(text: str, override: Any, options: dict[str, list[str]], keys: list[str]) -> Optional[str]:
    """One parsed override: a preset selection (``data=files``) or a field (``train.lr=1e-4``)."""
    key = override.key_or_group
    if key == "hydra" or key.startswith("hydra."):
        return None
    if "." not in key:
        if key in options:
            return None if override.is_delete() else _check_selection(text, key, override.value(), options)
        if key in GROUPS:
            first = dataclasses.fields(GROUPS[key])[0].name
            return (f"{text}: '{key}' has no presets (no {key}/ folder of presets); set its keys instead, "
                    f"e.g. {key}.{first}=<value>.")
        return _unknown_key(text, key, keys, list(options))
    group, name = key.split(".")[:2]
    if retired_key(key) and not override.is_delete():
        return f"{text}: unknown key '{key}'; {retired_key(key, override.value())}"
    if f"{group}.{name}" not in keys:
        return _unknown_key(text, f"{group}.{name}", keys)
    if key == f"{group}.{name}" and not override.is_delete():
        return _check_type(text, group, name, override.value())
    return None


def _check_type(text: str, group: str, name: str, value: Any) -> Optional[str]:
    """Assign the override to a scratch node of the group's schema, so every type error is reported."""
    from omegaconf.errors import OmegaConfBaseException

    scratch = _scratch(group)
    try:
        scratch[name] = value
    except OmegaConfBaseException as exc:
        expected = next(f.type for f in dataclasses.fields(GROUPS[group]) if f.name == name)
        return f"{text}: {str(exc).splitlines()[0]}; set {group}.{name} to a value of type {expected}."
    return None


_SCRATCH: dict[str, DictConfig] = {}


def _scratch(group: str) -> DictConfig:
    """A writable node of ``group``'s schema to assign overrides to (made once per process: building one from the
    dataclass takes longer than the check; an assignment that passes only changes a node nothing else reads)."""
    if group not in _SCRATCH:
        _SCRATCH[group] = OmegaConf.structured(GROUPS[group])
        _unfreeze(_SCRATCH[group])
    return _SCRATCH[group]


def _normalize(overrides: list[str]) -> list[str]:
    """Accept ``+experiment=name`` as well as ``experiment=name`` (config.yaml has ``experiment: null``)."""
    return [o[1:] if o.startswith("+experiment=") else o for o in overrides]


class PlainOverride:
    """A ``key=value`` override read without Hydra's parser: what ``OverridesParser.parse_override`` gives for it
    (key, value and its type), for the overrides ``plain_override`` accepts; the rest go to Hydra."""

    package = None

    def __init__(self, key: str, value: Any, text: str):
        self.key_or_group, self._value, self.input_line = key, value, text

    def value(self) -> Any:
        return self._value

    def is_delete(self) -> bool:
        return False

    def is_sweep_override(self) -> bool:
        return False


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_./:@%+-]+")
_INT = re.compile(r"[+-]?(?:0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+|[Ii][Nn][Ff]|[Nn][Aa][Nn])")


def plain_override(text: str) -> PlainOverride | None:
    """``group.key=value`` (or ``group=option``) whose value is a plain word, read as Hydra reads it: ``null``
    (any case) -> None, ``true`` / ``false`` (any case) -> bool, an integer or a float in Python's spelling
    (``+`` / ``-``, ``1e-4``, ``.5``, ``inf``, ``nan``) -> int / float, anything else -> the string. None (Hydra's
    parser decides) for any other key or value: quotes, brackets, spaces, ``${...}``, escapes, globs, ``+`` /
    ``++`` / ``~`` / ``@``, an empty value, and numbers with ``_`` (tests/unit/test_config_fast_path.py compares
    this with Hydra's parser on a table and on random words)."""
    key, sep, value = text.partition("=")
    if not sep or not _PLAIN_KEY.fullmatch(key) or not _PLAIN_VALUE.fullmatch(value):
        return None
    if "_" in value and value[0] in "0123456789+-.":  # Hydra's digits take "_" (1_000); left to it
        return None
    lower = value.lower()
    if lower == "null":
        parsed: Any = None
    elif lower in ("true", "false"):
        parsed = lower == "true"
    elif _INT.fullmatch(value):
        parsed = int(value)
    elif _FLOAT.fullmatch(value):
        parsed = float(value)
    else:
        parsed = value
    return PlainOverride(key, parsed, text)


def _parse(text: str, parsers: dict):
    """``plain_override(text)``, else Hydra's parse of it (its parser made once per call site, imported only then)."""
    plain = plain_override(text)
    if plain is not None:
        return plain
    if "hydra" not in parsers:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsers["hydra"] = OverridesParser.create()
    return parsers["hydra"].parse_override(text)


def _is_hydra_error(exc: BaseException) -> bool:
    from hydra.errors import HydraException

    return isinstance(exc, HydraException)


def _is_change(override) -> bool:
    if isinstance(override, PlainOverride):
        return True
    from hydra.core.override_parser.types import OverrideType

    return override.type == OverrideType.CHANGE


COMPOSITION_STORE_ENV = "MEGATRON_PACK_CACHE_DIR"
"""Where Hydra's compositions are kept between processes (``$XDG_CACHE_HOME/megatron_pack`` or
``~/.cache/megatron_pack`` unless set; ``off``: nowhere)."""


def cache_root() -> Optional[Path]:
    """The folder megatron_pack keeps what it may recompute in (``$MEGATRON_PACK_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/megatron_pack`` or ``~/.cache/megatron_pack``), or None (``off``): the composition store,
    tokenizers' vocabulary hashes (``data/formats/tokenizer.py``)."""
    import os

    root = os.environ.get(COMPOSITION_STORE_ENV)
    if root == "off":
        return None
    return Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron_pack"


def composition_file(key: tuple) -> Optional[Path]:
    """The file of the composition store for ``key`` (selections, folders, their files' bytes), or None (store
    off). The name also hashes what else shapes a composition: the schema's and this loader's source, the
    installed Hydra and OmegaConf (their files' sizes and times) and Python's version."""
    import hashlib
    import importlib.util
    import sys

    root = cache_root()
    if root is None:
        return None
    here = Path(__file__).resolve().parent
    code = b"".join((here / name).read_bytes() for name in ("schema.py", "choices.py", "loader.py", "search_path.py"))
    installed = []
    for package in ("hydra", "omegaconf"):
        spec = importlib.util.find_spec(package)
        stat = Path(spec.origin).stat() if spec and spec.origin else None
        installed.append((package, spec.origin if spec else None, stat and (stat.st_size, stat.st_mtime_ns)))
    digest = hashlib.blake2b(repr((key, installed, sys.version)).encode() + code, digest_size=20).hexdigest()
    return root / "compositions" / f"{digest}.pkl"


_STORE_MAX = 64
"""Compositions kept on disk (20 kB each); the oldest go first (a schema edited often leaves stale ones)."""


def _write_composition(path: Path, composed: DictConfig) -> None:
    """Write ``composed`` (pickled: read back only through ``_CompositionUnpickler``'s allowlist) atomically (a
    temporary file renamed: concurrent processes never read half a file), keeping the newest ``_STORE_MAX``; a
    folder that cannot be written leaves the store as it is, never an error."""
    import os
    import pickle
    import tempfile

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".composition-")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(composed, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        tmp = None
        stored = sorted(path.parent.glob("*.pkl"), key=lambda p: p.stat().st_mtime_ns)
        for old in stored[:-_STORE_MAX]:
            old.unlink(missing_ok=True)
    except Exception:  # noqa: BLE001 - a store that cannot be written (read-only home, full disk) is skipped
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


_COMPOSITION_TYPES = {
    "builtins": {"bool", "dict", "float", "int", "list", "str", "tuple"},
    "collections": {"defaultdict"},
    "typing": {"Any", "Dict", "List", "Optional", "Tuple", "Union"},
    "omegaconf.base": {"ContainerMetadata", "Metadata"},
    "omegaconf.dictconfig": {"DictConfig"},
    "omegaconf.listconfig": {"ListConfig"},
    "omegaconf.nodes": {"AnyNode", "BooleanNode", "FloatNode", "IntegerNode", "StringNode"},
}
"""What a pickled composition may name (the types a composed config is made of; the schema's dataclasses are
added by ``_CompositionUnpickler``): anything else, a function above all, is refused unrun."""


class _CompositionUnpickler:
    """Reads a stored composition through an allowlist of types (``_COMPOSITION_TYPES`` and the dataclasses of
    ``config/schema.py``), as ``training/checkpoint.py`` reads DCP metadata: a store file changed to carry a payload
    (``os.system``, ``eval``, ...) raises ``pickle.UnpicklingError`` before anything runs, and is composed anew.
    Pickle, not YAML, because the YAML read back onto the schema cost 0.05 CPU-s, a third of ``prepare``'s bare
    imports (issue 43 item 12); this costs 0.002."""

    @staticmethod
    def load(path: Path) -> DictConfig:
        import dataclasses
        import pickle

        import megatron_pack.config.schema as schema

        class Unpickler(pickle.Unpickler):
            def find_class(self, module: str, name: str):
                allowed = name in _COMPOSITION_TYPES.get(module, ()) or (
                    module == schema.__name__ and dataclasses.is_dataclass(getattr(schema, name, None)))
                if not allowed or "." in name:
                    raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a stored composition")
                return super().find_class(module, name)

        with open(path, "rb") as f:
            stored = Unpickler(f).load()
        if not isinstance(stored, DictConfig):
            raise pickle.UnpicklingError(f"a stored composition holds a {type(stored).__name__}")
        return stored


_COMPOSED: dict[tuple, DictConfig] = {}
"""Hydra's compositions of this process by (preset selections, search folders, what those folders hold): composing
takes about 0.25 CPU-s, and a run composes several times (the entry, its checks, each rank's loaders), a process
that loads many configs (a notebook, a sweep, the test suite) far more, mostly the same presets with other values."""
_COMPOSED_MAX = 64


def _folders_state(folders: Sequence[Path]) -> tuple:
    """``(path, digest of its bytes)`` of every file under ``folders``: a preset written or changed since makes a
    new key (its bytes, not its mtime, which may not move between two writes in a row)."""
    import hashlib

    return tuple((str(path), hashlib.blake2b(path.read_bytes(), digest_size=16).digest())
                 for folder in folders for path in sorted(Path(folder).rglob("*")) if path.is_file())


def _split_values(overrides: list[str], search: Sequence[Path]) -> tuple[list[str], list[Any]]:
    """``(the overrides Hydra needs to build its defaults list, the parsed value overrides)``.

    A value override is a plain ``group.key=value`` of a schema group (not a preset selection, not ``+``, ``++``
    or ``~``, not a sweep): Hydra applies exactly these after composing the defaults list, in their order
    (``ConfigLoaderImpl._apply_overrides_to_config``), so the composition of the rest can be reused for them.
    Anything else, or a folder on the search path whose name is the key, stays with Hydra."""
    parsers: dict = {}
    selections, values = [], []
    for text in overrides:
        try:
            override = _parse(text, parsers)
        except Exception as exc:  # noqa: BLE001
            if not _is_hydra_error(exc):
                raise
            selections.append(text)  # Hydra says what is wrong with it
            continue
        key = override.key_or_group
        plain = (_is_change(override) and override.package is None and not override.is_sweep_override()
                 and "." in key and key.split(".", 1)[0] in GROUPS and not any((Path(d) / key).exists() for d in search))
        if plain:
            values.append(override)
        else:
            selections.append(text)
    return selections, values


def _compose(overrides: list[str], user_dirs: list[Path]) -> DictConfig:
    """Hydra's composition of config.yaml with ``overrides``, searching ``user_dirs`` after the presets: a copy of
    the one composed before for the same preset selections and the same files, with the value overrides applied
    as Hydra applies them."""
    from omegaconf.errors import OmegaConfBaseException

    selections, values = _split_values(overrides, [PRESETS_DIR, *user_dirs])
    key = (tuple(selections), tuple(str(d) for d in user_dirs), _folders_state([PRESETS_DIR, *user_dirs]))
    if key not in _COMPOSED:
        if len(_COMPOSED) >= _COMPOSED_MAX:
            _COMPOSED.clear()
        _COMPOSED[key] = _stored_composition(key, selections, user_dirs)
    composed = copy.deepcopy(_COMPOSED[key])
    if all(isinstance(v, PlainOverride) for v in values):
        try:  # what Hydra's _apply_overrides_to_config does with a plain change (no package, no +, ++ or ~)
            for value in values:
                OmegaConf.update(composed, value.key_or_group, value.value(), merge=True)
            return composed
        except OmegaConfBaseException:  # refused: Hydra's own step below, for its message
            composed = copy.deepcopy(_COMPOSED[key])
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    values = [parser.parse_override(v.input_line) if isinstance(v, PlainOverride) else v for v in values]
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, composed)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError([_hydra_message(exc)]) from exc
    return composed


def _stored_composition(key: tuple, selections: list[str], user_dirs: list[Path]) -> DictConfig:
    """Hydra's composition for ``key``, read from the composition store where one was written for the same key
    (only with no user folders: ``--config-dir``, ``$MEGATRON_PACK_CONFIG_DIR`` and ``experiment=FILE`` compose
    anew in each process); else composed by Hydra and written there."""
    path = None if user_dirs else composition_file(key)
    if path is not None and path.is_file():
        try:
            return _CompositionUnpickler.load(path)
        except Exception:  # noqa: BLE001 - unreadable, damaged or refused by the allowlist: composed anew, rewritten
            pass
    composed = _compose_with_hydra(selections, user_dirs)
    if path is not None:
        _write_composition(path, composed)
    return composed


def _compose_with_hydra(overrides: list[str], user_dirs: list[Path]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        search = [f"hydra.searchpath=[{','.join(f'file://{d}' for d in user_dirs)}]"] if user_dirs else []
        with initialize_config_dir(config_dir=str(PRESETS_DIR), version_base=None):
            return compose(config_name="config", overrides=search + overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError([_hydra_message(exc)]) from exc


def _hydra_message(exc: BaseException) -> str:
    """One line from Hydra's error chain, naming the key (with a suggestion for unknown keys)."""
    lines: list[str] = []
    node: Optional[BaseException] = exc
    while node is not None:
        lines += [ln.strip() for ln in str(node).splitlines()
                  if ln.strip() and not ln.strip().startswith(("reference_type", "object_type"))]
        node = node.__cause__
    text = "; ".join(dict.fromkeys(ln.rstrip(":") for ln in lines if not ln.startswith("full_key")))
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    if key and "not in" in text and key.count(".") == 1:
        return _unknown_key(text, key, _all_keys())
    fix = f"; check {key}" if key else ""
    return f"{text or type(exc).__name__}{fix} (see docs/configuration.md)."


def to_config(composed: DictConfig) -> Config:
    """Build the dataclasses once; collect every group's field problems before raising."""
    groups: dict[str, Any] = {}
    problems: list[str] = []
    for name in GROUPS:
        try:
            groups[name] = OmegaConf.to_object(composed[name])
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    return Config(**groups)


def load_config(overrides: list[str], *, world_size: Optional[int] = None,
                dataset_meta: Optional[dict[str, Any]] = None,
                config_dirs: Sequence[str | Path] = ()) -> Config:
    """Compose the presets' config.yaml with ``overrides``, convert to a read-only ``Config``, validate.

    ``config_dirs`` (``--config-dir``) and ``$MEGATRON_PACK_CONFIG_DIR`` add user preset folders,
    searched after the shipped presets; ``experiment=path/to/run.yaml`` reads one file.

    >>> cfg = load_config(["experiment=quickstart", "packing.packed_sequence_size=1024", "model.seq_length=1024"])
    >>> cfg.parallel.context_parallel_size, cfg.packing.packed_sequence_size
    (2, 1024)
    """
    cfg = compose_config(overrides, config_dirs=config_dirs)
    validate(cfg, world_size=world_size, dataset_meta=dataset_meta)
    return cfg


def compose_config(overrides: list[str], *, config_dirs: Sequence[str | Path] = ()) -> Config:
    """``load_config`` without the cross-group rules: presets + overrides, each group's fields checked.

    For commands that complete the config from a prepared dataset before validating it
    (``megatron_pack.cli.run_config``).
    """
    user_dirs = user_config_dirs(config_dirs)
    problems = shadow_problems(user_dirs)
    if problems:
        raise ConfigError(problems)
    given = _normalize(list(overrides))
    with experiment_files(given) as (overrides, scratch):
        search = user_dirs + scratch
        files = {r.partition("=")[2]: o.partition("=")[2] for o, r in zip(given, overrides) if o != r}
        try:
            refused = override_problems(overrides, [PRESETS_DIR, *search])
            if refused:  # the other overrides are still composed, so every problem shows at once
                raise ConfigError(list(refused.values())
                                  + _field_problems([o for o in overrides if o not in refused], search))
            return apply_pretrained(to_config(_compose(overrides, search)), overrides)
        except ConfigError as exc:
            raise _naming_files(exc, files) from None


def _naming_files(exc: ConfigError, files: dict[str, str]) -> ConfigError:
    """``exc`` with Hydra's ``In 'experiment/run'`` written as the file the user named (``experiment=path/run.yaml``)."""
    problems = list(exc.problems)
    for name, path in files.items():
        problems = [p.replace(f"In 'experiment/{name}'", f"In {path} (experiment={path})") for p in problems]
    return ConfigError(problems)


def _field_problems(overrides: list[str], search: list[Path]) -> list[str]:
    """The one-group problems of ``overrides`` alone (cross-group rules wait for a config without refused keys)."""
    try:
        to_config(_compose(overrides, search))
    except ConfigError as exc:
        return exc.problems
    return []


def config_to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (for logs and ``--print-config``-style output)."""
    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))
