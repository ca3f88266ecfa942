"""tests/_session_checks.py: the module budgets and the working-folder guard that tests/conftest.py runs at the
end of every session, on tables of made-up durations and on a scratch repository."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _session_checks import BUDGET_FACTOR, MODULE_SECONDS, changes, over_budget, schedule_order, snapshot  # noqa: E402

LORA = "tests/functional/test_lora_train_export.py"
BUDGET_CASES = {
    "unit_module_within_the_least": ({"tests/unit/test_a.py::t1": 25.0, "tests/unit/test_a.py::t2": 30.0}, []),
    "unit_module_over_the_least": ({"tests/unit/test_a.py::t1": 50.0, "tests/unit/test_a.py::t2[x]": 20.0},
                                   ["tests/unit/test_a.py took 70 s, over its budget of 60 s"]),
    "functional_least_is_larger": ({"tests/functional/test_new.py::t": 110.0}, []),
    "measured_module_within_its_budget": ({f"{LORA}::t": BUDGET_FACTOR * MODULE_SECONDS[LORA] - 1}, []),
    "measured_module_over_its_budget": ({f"{LORA}::t": BUDGET_FACTOR * MODULE_SECONDS[LORA] + 1, f"{LORA}::u": 0.5},
                                [f"{LORA} took {BUDGET_FACTOR * MODULE_SECONDS[LORA] + 1.5:.0f} s, over its budget of "
                                 f"{BUDGET_FACTOR * MODULE_SECONDS[LORA]:.0f} s"]),
    "only_the_module_over_fails": ({"tests/unit/test_a.py::t": 61.0, "tests/unit/test_b.py::t": 59.0},
                                   ["tests/unit/test_a.py took 61 s"]),
}


@pytest.mark.parametrize("durations,expected", BUDGET_CASES.values(), ids=list(BUDGET_CASES))
def test_module_budgets(durations, expected):
    messages = over_budget(durations)
    assert len(messages) == len(expected)
    for message, start in zip(messages, expected):
        assert message.startswith(start), message
        assert "MODULE_SECONDS" in message and "Slowest items" in message
    if expected:  # the module's slowest item is listed first
        module = expected[0].split()[0]
        items = sorted((n for n in durations if n.startswith(module)), key=durations.get, reverse=True)
        assert [message.index(n) for n in items] == sorted(message.index(n) for n in items)


def test_every_measured_module_exists():
    repo = Path(__file__).resolve().parents[2]
    missing = [m for m in MODULE_SECONDS if not (repo / m).is_file()]
    assert len(MODULE_SECONDS) > 20 and not missing, missing


def test_the_longest_modules_are_scheduled_first():
    modules = ["tests/unit/test_unmeasured.py", LORA, "tests/functional/test_docs_commands.py"]
    assert MODULE_SECONDS["tests/functional/test_docs_commands.py"] > MODULE_SECONDS[LORA]
    assert sorted(modules, key=schedule_order) == modules[::-1]


GUARD_CASES = {
    "untouched": (lambda repo: None, []),
    "file_created": (lambda repo: (repo / "runs" / "new.txt").write_text("x"), ["created runs/new.txt"]),
    "folder_created": (lambda repo: (repo / "data" / "ds").mkdir(), ["created data/ds"]),
    "file_changed": (lambda repo: (repo / "runs" / "old.txt").write_text("longer"), ["changed runs/old.txt"]),
    "file_removed": (lambda repo: (repo / "runs" / "old.txt").unlink(), ["removed runs/old.txt"]),
    "folder_removed": (lambda repo: (repo / "data").rmdir(), ["removed data"]),
    "other_folder_ignored": (lambda repo: (repo / "src.txt").write_text("y"), []),
}


@pytest.mark.parametrize("act,expected", GUARD_CASES.values(), ids=list(GUARD_CASES))
def test_working_folder_guard(tmp_path, act, expected):
    (tmp_path / "runs").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "runs" / "old.txt").write_text("x")
    before = snapshot(tmp_path)
    assert set(before) == {"runs", "data", "runs/old.txt"}  # the snapshot really saw the folders
    act(tmp_path)
    assert changes(before, snapshot(tmp_path)) == expected


def test_the_session_runs_in_a_scratch_working_folder(request, tmp_path_factory):
    """tests/conftest.py's guard is on: a test's working folder is the session's scratch folder under pytest's
    base temp, not the folder pytest started in (a checkout where the README's quickstart left ``runs/`` and
    ``data/``), so a relative ``runs/quickstart`` or ``data/synthetic`` in a test never reaches them.
    tests/functional/test_readme_commands.py runs this test from a folder holding them, after the README's
    commands."""
    here, started = Path.cwd().resolve(), Path(request.config.invocation_params.dir).resolve()
    assert here != started and here.is_relative_to(tmp_path_factory.getbasetemp().resolve()), (here, started)
    assert here.name.startswith("working_folder"), here  # the guard's folder (other tests may write in it)
