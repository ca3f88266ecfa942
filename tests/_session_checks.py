"""Checks the test session makes on itself (run from ``tests/conftest.py``).

1. **Module budgets.** Every test module's total time (setup, call and teardown of its items, so a
   module-scoped world counts once) must stay within its budget: ``BUDGET_FACTOR`` times its measured
   quiet time in ``MODULE_SECONDS``, and at least its folder's ``MIN_BUDGET_S`` (room for a 2-core
   machine loaded by other runs beside it). A module over budget fails the session and prints its
   slowest items: a new case joins an existing world (``sub_world``, a pooled ``spawn_world``, the
   session's torchrun world of ``_train_world.run_in_world``) instead of starting its own, or ``MODULE_SECONDS``
   gets the new measurement
   (``MEGATRON_PACK_TEST_CPU_LOG``, below). The same table orders the session: the scheduler of
   ``tests/conftest.py`` hands the longest modules out first.
2. **The working folder stays untouched.** The repository's ``runs/`` and ``data/`` (where the
   README's quickstart writes) are the same after the session as before it: tests work in their
   own temporary folders. A file created, changed or removed there fails the session, naming it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

WORKING_FOLDERS = ("runs", "data")
"""The repository's folders the README's commands write and the tests must leave alone."""

MIN_BUDGET_S = {"tests/unit": 60.0, "tests/functional": 120.0}
"""The least budget of a module of each folder (a module not in ``MODULE_SECONDS`` gets this)."""
BUDGET_FACTOR = 4.0
"""A module's budget is this many times its measured quiet seconds: this machine's speed moved by a third between
hours of one day, and a world module running beside another module took up to 2.6x its quiet seconds
(test_user_path_matrix 247 s of 96, docs/benchmarks.md run 4)."""

MODULE_SECONDS = {
    # seconds per module (setup, call and teardown of its items) of a fresh-clone `.ci/run` on a quiet 2-core
    # machine (2026-12-05, run 6 of docs/benchmarks.md's issue-33 table); modules under 5 s are left out
    "tests/functional/test_user_path_matrix.py": 157,
    "tests/functional/test_docs_commands.py": 156,
    "tests/functional/test_readme_commands.py": 143,
    "tests/functional/test_vlm_cli.py": 103,
    "tests/functional/test_training_run.py": 101,
    "tests/functional/test_slurm.py": 100,
    "tests/functional/test_hf_train_export.py": 86,
    "tests/functional/test_reliability_restart.py": 78,
    "tests/functional/test_moe.py": 76,
    "tests/functional/test_launch.py": 67,
    "tests/functional/test_lora_train_export.py": 63,
    "tests/functional/test_pipeline_parallel.py": 58,
    "tests/functional/test_optimizer_checkpoint.py": 20,
    "tests/functional/test_reliability_signals.py": 46,
    "tests/functional/test_train_resume_quickstart.py": 41,
    "tests/unit/test_plan_manifest.py": 39,
    "tests/functional/test_hf_models.py": 29,
    "tests/unit/test_user_refusals.py": 29,
    "tests/functional/test_train_steps.py": 28,
    "tests/unit/test_reliability_fuzz.py": 28,
    "tests/unit/test_dist_harness.py": 28,
    "tests/functional/test_vlm_model.py": 26,
    "tests/unit/test_prepare.py": 22,
    "tests/functional/test_window_sink_cli.py": 22,  # measured alone (its torchrun world's start-up included)
    "tests/functional/test_qwen3_5_cli.py": 22,  # measured alone (its torchrun world's start-up included)
    "tests/functional/test_qwen3_vl_cli.py": 19,  # measured alone (its torchrun world's start-up included)
    "tests/unit/test_qwen3_vl.py": 31,  # measured alone on a shared machine (its 2-rank spawn_world included)
    "tests/functional/test_reliability_folders.py": 22,
    "tests/unit/test_vlm_data.py": 21,
    "tests/unit/test_resume_check.py": 18,
    "tests/functional/test_model_verify.py": 17,
    "tests/functional/test_reliability_crash.py": 17,
    "tests/unit/test_reliability_inputs.py": 16,
    "tests/unit/test_bad_records.py": 14,
    "tests/unit/test_bridge.py": 13,
    "tests/unit/test_run_config.py": 13,
    "tests/functional/test_hf_memory.py": 13,
    "tests/unit/test_online.py": 12,
    "tests/unit/test_prepare_record.py": 12,
    "tests/unit/test_config_loader.py": 12,
    "tests/unit/test_fp8_pack_rule.py": 11,
    "tests/functional/test_model_parallel.py": 11,
    "tests/functional/test_train_parallel.py": 11,
    "tests/unit/test_packing.py": 11,
    "tests/unit/test_vlm_batch.py": 10,
    "tests/unit/test_collectives_module.py": 10,
    "tests/functional/test_recompute.py": 10,
    "tests/unit/test_chat_skeleton.py": 9,
    "tests/unit/test_reliability_datasets.py": 9,
    "tests/unit/test_mixing.py": 9,
    "tests/functional/test_lora_parallel.py": 9,
    "tests/unit/test_loader_protocol.py": 9,
    "tests/unit/test_report.py": 8,
    "tests/unit/test_cli_help.py": 8,
    "tests/unit/test_packing_strategies.py": 8,
    "tests/functional/test_reliability_padding_ranks.py": 8,
    "tests/functional/test_in_batch_train.py": 8,
    "tests/functional/test_verify_strategies.py": 7,
    "tests/unit/test_tokenizer.py": 6,
    "tests/unit/test_chat_formats.py": 6,
    "tests/unit/test_reliability_properties.py": 6,
    "tests/unit/test_one_home.py": 5,
    "tests/unit/test_balance.py": 5,
    "tests/unit/test_recipes.py": 5,
    "tests/unit/test_builder.py": 5,
    "tests/unit/test_layout.py": 5,
}


def module_of(nodeid: str) -> str:
    """``tests/unit/test_x.py::test_y[case]`` -> ``tests/unit/test_x.py``."""
    return nodeid.split("::", 1)[0]


def budget_of(module: str) -> float:
    folder = module.rsplit("/", 1)[0]
    least = MIN_BUDGET_S.get(folder, MIN_BUDGET_S["tests/unit"])
    return max(least, BUDGET_FACTOR * MODULE_SECONDS.get(module, 0.0))


def schedule_order(module: str) -> float:
    """Sort key of a module in the session: the longest (by ``MODULE_SECONDS``) first."""
    return -MODULE_SECONDS.get(module, 0.0)


def over_budget(durations: dict[str, float]) -> list[str]:
    """One message per module over its budget, given seconds per node id (all phases summed).

    For ``{"tests/unit/a.py::t1": 50, "tests/unit/a.py::t2": 20}`` (70 s > the 60 s a unit module gets at least)
    the message names ``tests/unit/a.py``, its total, its budget and ``t1`` as the slowest item.
    """
    per_module: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for nodeid, seconds in durations.items():
        per_module[module_of(nodeid)].append((seconds, nodeid))
    messages = []
    for module, items in sorted(per_module.items()):
        total, budget = sum(s for s, _ in items), budget_of(module)
        if total > budget:
            slowest = "\n".join(f"    {s:7.1f} s  {nodeid}" for s, nodeid in sorted(items, reverse=True)[:8])
            messages.append(f"{module} took {total:.0f} s, over its budget of {budget:.0f} s "
                            f"({BUDGET_FACTOR:.0f} x its seconds in tests/_session_checks.py MODULE_SECONDS): make "
                            f"new cases join an existing world or run, or put the new measurement there. Slowest "
                            f"items:\n"
                            f"{slowest}")
    return messages


def snapshot(repo: Path) -> dict[str, tuple[int, int]]:
    """``{path relative to repo: (size, mtime_ns)}`` of every file under the working folders, and ``(0, 0)`` for
    every folder (a folder counts as created or removed; its entries say what changed in it)."""
    found = {}
    for name in WORKING_FOLDERS:
        root = repo / name
        if not root.exists():
            continue
        for path in [root, *root.rglob("*")]:
            stat = path.lstat()
            found[str(path.relative_to(repo))] = (stat.st_size, stat.st_mtime_ns) if path.is_file() else (0, 0)
    return found


def changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """``created PATH`` / ``changed PATH`` / ``removed PATH`` for each difference, sorted by path."""
    out = []
    for path in sorted(set(before) | set(after)):
        if path not in before:
            out.append(f"created {path}")
        elif path not in after:
            out.append(f"removed {path}")
        elif before[path] != after[path]:
            out.append(f"changed {path}")
    return out


def cpu_by_module(folder: Path) -> list[tuple[str, float, float, int]]:
    """``(module, CPU-seconds, wall seconds, items)`` from a ``MEGATRON_PACK_TEST_CPU_LOG`` folder, most CPU first."""
    import json

    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for path in Path(folder).glob("cpu-*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            entry = totals[module_of(row["id"])]
            entry[0] += row["cpu"]
            entry[1] += row["wall"]
            entry[2] += 1
    return sorted(((m, c, w, int(n)) for m, (c, w, n) in totals.items()), key=lambda r: -r[1])


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["cpu"]:
        rows = cpu_by_module(Path(sys.argv[2]))
        print(f"{'CPU s':>8} {'wall s':>8} {'items':>6}  module   (total CPU {sum(r[1] for r in rows):.0f} s)")
        for module, cpu, wall, n in rows:
            print(f"{cpu:8.1f} {wall:8.1f} {n:6d}  {module}")
