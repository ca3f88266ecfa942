"""docs/configuration.md stays true: every field, default, rule and preset is documented."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

from megatron_pack.config import Config, ConfigError, load_config
from megatron_pack.config.loader import config_dir
from megatron_pack.config.schema import GROUPS
from megatron_pack.config.search_path import presets

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "configuration.md").read_text()
SCHEMA = ROOT / "megatron_pack" / "config" / "schema.py"
validate_module = importlib.import_module("megatron_pack.config.validate")


def doc_cell(value) -> str:
    """How a default is written in the tables: YAML spelling in backticks."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def documented_rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOC.splitlines():
        match = re.match(r"\|\s*`([a-z_]+\.[a-z_0-9]+)`\s*\|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = [c.strip() for c in match.group(2).split("|")]
    return rows


FIELDS = [(group, f) for group, cls in GROUPS.items() for f in dataclasses.fields(cls)]


def test_groups_match_config():
    assert list(GROUPS) == [f.name for f in dataclasses.fields(Config)]
    assert len(FIELDS) > 80


@pytest.mark.parametrize("group,field", FIELDS, ids=[f"{g}.{f.name}" for g, f in FIELDS])
def test_every_field_documented_with_its_default(group, field):
    rows = documented_rows()
    key = f"{group}.{field.name}"
    # the declared default (a derived one, like train.min_lr's None = lr / 10, is documented as such)
    default = field.default if field.default is not dataclasses.MISSING else getattr(GROUPS[group](), field.name)
    expected = f"| `{key}` | {doc_cell(default)} | <meaning> |"
    assert key in rows, f"{key} is missing from docs/configuration.md; add the row {expected}"
    cells = rows[key]
    assert cells[0] == doc_cell(default), f"{key}: the documented default is {cells[0]}; expected {expected}"
    assert len(cells) >= 2 and len(cells[1]) > 3, f"{key}: document its meaning"


def test_no_documented_key_is_stale():
    known = {f"{g}.{f.name}" for g, f in FIELDS}
    stale = set(documented_rows()) - known
    assert not stale, f"docs/configuration.md documents keys that do not exist: {sorted(stale)}"


def test_every_field_has_a_docstring_in_schema():
    tree = ast.parse(SCHEMA.read_text())
    missing, checked = [], 0
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                checked += 1
                nxt = body[i + 1] if i + 1 < len(body) else None
                if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    missing.append(f"{cls.name}.{stmt.target.id}")
    assert checked >= len(FIELDS)
    assert not missing, f"fields without a docstring under them in schema.py: {missing}"


def test_every_rule_documented():
    rules = [name for name, _ in inspect.getmembers(validate_module, inspect.isfunction) if name.startswith("_validate_")]
    assert len(rules) >= 14
    missing = [r for r in rules if f"`{r}`" not in DOC]
    assert not missing, f"validation rules missing from docs/configuration.md: {missing}"


def test_every_preset_documented():
    options = presets(config_dir())
    assert set(options) >= {"model", "data", "parallel", "experiment"}
    for group, names in options.items():
        row = next(line for line in DOC.splitlines() if line.startswith(f"| `{group}` |"))
        for name in names:
            assert f"`{name}`" in row, f"preset {group}={name} is missing from the presets table"


def test_typo_example_in_doc_is_real_output():
    with pytest.raises(ConfigError) as info:
        load_config(["packing.packed_sequnce_size=8", "modle.num_layers=2", "data=synthtic", "train.lr=fast"])
    assert len(info.value.problems) == 4
    for problem in info.value.problems:
        assert f"  - {problem}" in DOC
