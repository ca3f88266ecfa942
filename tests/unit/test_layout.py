"""The package layout: the layers import one way, and the shared value lists and rules are defined
once (one home per name: tests/unit/test_one_home.py)."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

LAYERS = ["config", "data", "parallel", "model", "training", "cli"]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in the file, lazy imports included)."""
    graph = {}
    for f in (ROOT / "megatron_pack").rglob("*.py"):
        module = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = {m for m in _imports(f) if m.startswith("megatron_pack")}
    return graph


def _layer(module: str):
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_import_one_way():
    graph = _import_graph()
    assert sum(len(d) for d in graph.values()) > 50, "too few imports found: the check would pass vacuously"
    upward = [f"{m} -> {t}" for m, deps in graph.items() for t in deps
              if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)]
    assert not upward, f"imports that run up config < data < parallel < model < training < cli: {upward}"


def test_no_import_cycle():
    graph = _import_graph()
    done, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            return
        if m in done or m not in graph:
            return
        stack.append(m)
        for t in sorted(graph[m]):
            visit(t)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert len(done) > 30  # guard: the walk reached the package's modules
    assert not cycles, cycles


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_config_layout_rules_are_torch_free_and_imports_only_config():
    """The pad and world-size rules sit at the bottom: no torch, numpy or higher package layer."""
    found = _imports(ROOT / "megatron_pack/config/layout.py")
    assert found, "no import found: the check would pass vacuously"
    assert not {m for m in found if m.split(".")[0] in ("torch", "numpy")}
    assert all(m.startswith("megatron_pack.config") for m in found if m.startswith("megatron_pack"))


def test_parallel_does_not_import_model():
    files = sorted((ROOT / "megatron_pack/parallel").glob("*.py"))
    assert len(files) >= 3
    for f in files:
        assert not [m for m in _imports(f) if m.startswith("megatron_pack.model")], f


def test_metadata_format_imports_neither_reader_nor_writer():
    found = _imports(ROOT / "megatron_pack/data/store/metadata.py")
    assert "megatron_pack.data.formats.sources" in found  # guard: the parse saw the module's imports
    for forbidden in ("megatron_pack.data.prepare", "megatron_pack.data.batches.dataset"):
        assert forbidden not in found


def test_loading_a_config_does_not_import_torch():
    code = ("import sys; from megatron_pack.config import load_config, validate; "
            "from megatron_pack.config.layout import pad_multiple; validate(load_config([]), world_size=2); "
            "print(pad_multiple(2, 4, True), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["8", "False"], out.stdout + out.stderr


# every key with a fixed set of values and its list in config.choices (issue 23 item 5: one list per key)
from megatron_pack.config.choices import CHOICES  # noqa: E402

VALUE_LISTS = sorted(CHOICES.items())
WITH = {"model.recompute_method": dict(recompute_granularity="full")}
"""Fields a key's values need set to validate at all."""


@pytest.mark.parametrize("key,values", VALUE_LISTS, ids=[k for k, _ in VALUE_LISTS])
def test_value_list_is_what_the_schema_accepts_and_the_docs_name(key, values):
    from megatron_pack.config.schema import GROUPS, ConfigError

    assert len(values) >= 2
    group, field = key.split(".")
    for value in values:
        GROUPS[group](**{field: value}, **WITH.get(key, {}))  # every listed value validates
    with pytest.raises(ConfigError, match=f"must be one of {list(values)}".replace("[", r"\[").replace("+", r"\+")):
        GROUPS[group](**{field: "not_a_value"}, **WITH.get(key, {}))
    row = next(line for line in (ROOT / "docs/configuration.md").read_text().splitlines() if line.startswith(f"| `{key}` |"))
    assert all(f"'{v}'" in row for v in values), f"docs/configuration.md's {key} row must name every value: {row}"


def test_value_lists_are_defined_once():
    """The consumers use the config list itself, not a copy of its values (schema.py writes none inline)."""
    from megatron_pack.config import choices
    from megatron_pack.data.packing import algorithms
    from megatron_pack.model import attention

    assert algorithms.ALGORITHMS is choices.PACKING_ALGORITHMS
    assert attention.ATTENTION_MODES is choices.ATTENTION_MODES
    literals = {tuple(values) for values in CHOICES.values()} | {choices.CUDA_GRAPH_SCOPES, choices.CHAT_ROLES}
    found = []
    for f in (ROOT / "megatron_pack").rglob("*.py"):
        if f.name == "choices.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) for e in node.elts):
                if tuple(e.value for e in node.elts) in literals:
                    found.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"value lists written again (import them from megatron_pack.config.choices): {found}"
    schema = ast.parse((ROOT / "megatron_pack/config/schema.py").read_text())
    inline = [n.lineno for n in ast.walk(schema) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "_choice"
              and any(isinstance(a, (ast.Tuple, ast.List)) for a in n.args)]
    assert not inline, f"schema.py lines {inline} pass a choice list inline; name it in config/choices.py CHOICES"


@pytest.mark.parametrize("algorithm", ["bfd", "ffd", "first_fit_shuffle", "sequential"])
def test_every_listed_algorithm_plans(algorithm):
    from megatron_pack.config.choices import PACKING_ALGORITHMS
    from megatron_pack.data.packing.algorithms import plan_packing

    assert algorithm in PACKING_ALGORITHMS
    plan = plan_packing([5, 3, 4, 2, 6], capacity=8, algorithm=algorithm, seed=0)
    assert sorted(int(i) for b in plan.bins() for i in b) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("value,multiple,expected", [
    (0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (13, 8, 16), (7, 1, 7)],
    ids=["zero", "one", "exact", "over", "13_to_16", "multiple_1"])
def test_round_up_hand_computed(value, multiple, expected):
    from megatron_pack.config.layout import round_up

    assert round_up(value, multiple) == expected


def test_packer_and_collate_round_alike():
    """The plan's padded lengths are the lengths the collate pads each sample to (one round_up)."""
    import numpy as np
    from hypothesis import given, settings, strategies as st

    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.data.packing.algorithms import thd_lengths

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.integers(2, 20), min_size=1, max_size=5), st.sampled_from([1, 2, 4, 8]))
    def check(num_ids, multiple):
        samples = [{"input_ids": list(range(3, 2 + n)) + [2], "loss_mask": [1] * n} for n in num_ids]
        planned = thd_lengths(num_ids, multiple)
        batch = collate_thd(samples, pack_size=int(planned.sum()), pad_multiple=multiple)
        cu = np.asarray(batch["cu_seqlens_padded"])
        assert (np.diff(cu) == planned).all()

    check()


# ----- training/loop.py holds the loop only --------------------------------------------------
LOOP = ROOT / "megatron_pack" / "training" / "loop.py"
LOOP_MAX_LINES = 365  # the step also reports model FLOP/s and MFU, bounds its history, runs the CUDA-graph capture
LOOP_DEFINES = {"Trainer", "build_loader", "build_trainer", "_should_evaluate", "run_training"}
"""Everything loop.py defines at module level: the trainer, its builders and the loop."""
NOT_IN_LOOP = {  # what moved out, and where it lives now
    "checkpoint I/O (trainer_checkpoint.py, checkpoint.py)": ("torch.save", "torch.load", "dcp.", "sharded_state",
                                                              "read_rank_state", "set_rng_state", "ckpt."),
    "DDP wrapping (chunks.py)": ("DistributedDataParallel", "Float16Module", "build_model("),
    "the resume policy (trainer_checkpoint.py, resume.py)": ("resume_choice(", "collective_verify", "DATA_SETTINGS)",
                                                            "allow_changed", "load_state_dict(state"),
    "the step outcome (outcome.py)": ("all_reduce", "broadcast", "isfinite", "check_weights(self"),
    "the CPU schedule (schedule.py)": ("no_sync", ".backward("),
}
TRAINER_DELEGATES = {"save": "save_trainer", "load": "load_trainer", "load_weights": "load_trainer_weights"}


def _loop_tree() -> ast.Module:
    return ast.parse(LOOP.read_text(encoding="utf-8"))


def test_loop_is_within_its_line_budget():
    num_lines = len(LOOP.read_text(encoding="utf-8").splitlines())
    assert 100 < num_lines <= LOOP_MAX_LINES, f"training/loop.py has {num_lines} lines (budget {LOOP_MAX_LINES})"


def test_loop_defines_the_loop_only():
    defined = {node.name for node in _loop_tree().body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert defined == LOOP_DEFINES


@pytest.mark.parametrize("what", sorted(NOT_IN_LOOP))
def test_loop_holds_no_code_that_moved_out(what):
    """Code outside docstrings and comments (the module docstring may name where things went)."""
    tree = _loop_tree()
    for node in ast.walk(tree):  # drop every docstring
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body.pop(0)
    code = ast.unparse(tree)
    assert "class Trainer" in code and "def compute_gradients" in code  # the check reads the real code
    found = [needle for needle in NOT_IN_LOOP[what] if needle in code]
    assert not found, f"training/loop.py still holds {what}: {found}"


def test_trainer_checkpoint_methods_only_delegate():
    """``Trainer.save`` / ``load`` / ``load_weights`` stay (users and tests call them) as one-line
    calls into trainer_checkpoint.py, where checkpointing lives."""
    trainer = next(n for n in _loop_tree().body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    methods = {n.name: n for n in trainer.body if isinstance(n, ast.FunctionDef)}
    assert {"compute_gradients", "train_step", *TRAINER_DELEGATES} <= set(methods)
    for name, target in TRAINER_DELEGATES.items():
        statements = [s for s in methods[name].body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        assert len(statements) == 1 and target in ast.unparse(statements[0]), name
