"""docs/reliability.md matches the tests: every test it cites exists, every reliability test is cited,
and every row claims zero data lost (or a counted, reported number)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TALLY = REPO / "docs" / "reliability.md"
REFERENCE = re.compile(r"(tests/[\w/]+\.py)::(\w+)(?:\[([\w-]+)\])?")
OWN_FILES = sorted((REPO / "tests").glob("*/test_reliability_*.py")) + [REPO / "tests" / "unit" / "test_security.py"]


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def _table_rows() -> list[list[str]]:
    rows = []
    for line in TALLY.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        is_header = cells[-1] == "Data lost"
        if line.startswith("|") and not set(line) <= set("|- ") and not is_header and len(cells) >= 3:
            rows.append(cells)
    return rows


def test_every_cited_test_exists():
    refs = REFERENCE.findall(TALLY.read_text(encoding="utf-8"))
    assert len(refs) >= 60  # the tally really cites tests
    for path, name, case in refs:
        source = REPO / path
        assert source.is_file(), f"docs/reliability.md cites {path}, which does not exist"
        assert name in _test_functions(source), f"docs/reliability.md cites {path}::{name}, which does not exist"
        if case:  # a parametrize id: it must be spelled in the test module
            assert f'"{case}"' in source.read_text(encoding="utf-8") or f"'{case}'" in source.read_text(
                encoding="utf-8"), f"{path}::{name}[{case}]: no such case id"


def test_every_reliability_test_is_in_the_tally():
    cited = {(path, name) for path, name, _ in REFERENCE.findall(TALLY.read_text(encoding="utf-8"))}
    assert len(OWN_FILES) >= 7
    for source in OWN_FILES:
        rel = str(source.relative_to(REPO))
        for name in _test_functions(source):
            if source.name == "test_reliability_tally.py":
                continue
            assert (rel, name) in cited, f"{rel}::{name} is not in docs/reliability.md"


def test_every_row_loses_no_data():
    rows = _table_rows()
    assert len(rows) >= 50
    for row in rows:
        lost = row[-1]
        assert lost.startswith("0"), f"row claims data lost: {row[0]!r} -> {lost!r}"
        assert REFERENCE.search(row[-2]), f"row without a test: {row[0]!r}"
