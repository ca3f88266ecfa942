"""One home per name (STYLE.md 22): every name is imported from the module that defines it; the
public names DESIGN.md documents at another path resolve through one table that warns
(megatron_pack/_deprecated.py); no module re-exports a name it does not use."""

import ast
import importlib
import pathlib
import re
import warnings

import pytest

from megatron_pack import _deprecated

ROOT = pathlib.Path(__file__).resolve().parents[2]

# DESIGN.md "Public surface", Python: the documented path of each public name (written out here, not
# read from the table, so a name dropped from the table fails)
PUBLIC = [
    "megatron_pack.config.load_config", "megatron_pack.config.validate", "megatron_pack.config.ConfigError",
    "megatron_pack.config.Config", "megatron_pack.data.packing.plan_packing", "megatron_pack.data.thd.collate_thd",
    "megatron_pack.parallel.cp.pad_multiple", "megatron_pack.parallel.cp.thd_partition_indices",
    "megatron_pack.parallel.cp.slice_thd_batch", "megatron_pack.training.step.get_packed_seq_params",
    "megatron_pack.training.step.loss_func", "megatron_pack.data.in_batch.pack_batch_sequences",
    "megatron_pack.parallel.groups.initialize_parallel", "megatron_pack.data.batches.protocol.BatchLoader",
    "megatron_pack.training.loop.build_trainer",
]

# where each moved public name lives now (hand-written: the table must agree)
MOVED = [
    ("megatron_pack.data.thd.collate_thd", "megatron_pack.data.batches.thd", "collate_thd"),
    ("megatron_pack.data.in_batch.pack_batch_sequences", "megatron_pack.data.batches.in_batch", "pack_batch_sequences"),
    ("megatron_pack.data.packing.plan_packing", "megatron_pack.data.packing.algorithms", "plan_packing"),
    ("megatron_pack.parallel.cp.pad_multiple", "megatron_pack.config.layout", "pad_multiple"),
]

# the one package whose documented names are its submodules' (DESIGN.md: "megatron_pack.config: the
# config dataclasses, load_config, validate, ConfigError"); no other module may hold names it does not use
DOCUMENTED_PACKAGE = {"megatron_pack/config/__init__.py": {
    "load_config", "validate", "Config", "ConfigError", "CheckpointConfig", "DataConfig", "DDPConfig", "ExportConfig",
    "LoggingConfig", "ModelConfig", "PackingConfig", "ParallelConfig", "TrainConfig", "VerifyConfig"}}


def _split(path: str) -> tuple[str, str]:
    module, _, name = path.rpartition(".")
    return module, name


@pytest.mark.parametrize("old,module,name", MOVED, ids=[o for o, _, _ in MOVED])
def test_moved_public_name_warns_and_is_the_same_object(old, module, name):
    assert _deprecated.MOVED[old] == f"{module}.{name}"
    old_module, old_name = _split(old)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {module}.{name}")) as caught:
        found = getattr(importlib.import_module(old_module), old_name)
    assert found is getattr(importlib.import_module(module), name)
    assert caught[0].filename == __file__  # the warning points at the caller's line


def test_the_table_holds_the_moved_public_names_only():
    assert len(MOVED) >= 4
    assert set(_deprecated.MOVED) == {old for old, _, _ in MOVED}
    assert set(_deprecated.MOVED) <= set(PUBLIC)


@pytest.mark.parametrize("old_module", _deprecated.OLD_MODULES)
def test_old_module_path_imports_and_holds_only_its_entries(old_module):
    old, = [k for k in _deprecated.MOVED if _split(k)[0] == old_module]
    namespace = {}
    with pytest.warns(DeprecationWarning, match=re.escape(_deprecated.MOVED[old])):
        exec(f"from {old_module} import {_split(old)[1]}", namespace)
    new_module, name = _split(_deprecated.MOVED[old])
    assert namespace[name] is getattr(importlib.import_module(new_module), name)
    held = [n for n in vars(importlib.import_module(old_module)) if not n.startswith("__")]
    assert held == [], f"{old_module} holds names of its own: {held}"
    with pytest.raises(AttributeError, match=f"module '{old_module}' has no attribute 'THD_KEYS'"):
        getattr(importlib.import_module(old_module), "THD_KEYS")


@pytest.mark.parametrize("path", PUBLIC)
def test_design_public_surface_resolves(path):
    module, name = _split(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore" if path in _deprecated.MOVED else "error", message=".* moved to ",
                                category=DeprecationWarning)
        assert callable(getattr(importlib.import_module(module), name))


def test_readme_python_example_runs_without_a_moved_path():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks and "collate_thd" in blocks[0], "README's Python example not found: the check would pass vacuously"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".* moved to ", category=DeprecationWarning)
        namespace = {}
        exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["local"]["tokens"].shape[1] == 4  # half of the 8-token pack on CP rank 0


# ----- no re-exports: every imported name is used by the module importing it ------------------
def _used_names(tree: ast.Module) -> set[str]:
    """Names the module reads, string annotations (``"Config"`` under TYPE_CHECKING) included."""
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    annotations = [n.annotation for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.AnnAssign))]
    annotations += [n.returns for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in annotations:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            used |= {n.id for n in ast.walk(ast.parse(node.value, mode="eval")) if isinstance(n, ast.Name)}
    return used


def unused_imports(source: str) -> list[str]:
    """``from X import name`` statements whose name the module never uses (``__all__`` is no use)."""
    tree = ast.parse(source)
    used = _used_names(tree)
    return [f"{node.lineno}: {alias.asname or alias.name}" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module != "__future__"
            for alias in node.names if (alias.asname or alias.name) not in used]


UNUSED_CASES = [
    ("reexport", "from a import b  # noqa: F401\n", ["1: b"]),
    ("listed_in_all", "from a import b\n__all__ = ['b']\n", ["1: b"]),
    ("used", "from a import b\nprint(b)\n", []),
    ("used_as_alias", "from a import b as c\nc()\n", []),
    ("string_annotation", "from a import B\ndef f(x: 'B') -> 'B': ...\n", []),
    ("lazy_unused", "def f():\n    from a import b  # noqa: F401\n", ["2: b"]),
]


@pytest.mark.parametrize("source,expected", [c[1:] for c in UNUSED_CASES], ids=[c[0] for c in UNUSED_CASES])
def test_unused_import_check_on_cases(source, expected):
    assert unused_imports(source) == expected


def test_no_module_reexports_a_name_it_does_not_use():
    files = sorted((ROOT / "megatron_pack").rglob("*.py"))
    assert len(files) > 80, "too few modules found: the check would pass vacuously"
    found = []
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        allowed = DOCUMENTED_PACKAGE.get(rel, set())
        found += [f"{rel}:{u}" for u in unused_imports(f.read_text(encoding="utf-8")) if u.split(": ")[1] not in allowed]
    assert not found, ("imported and not used (import the name from the module that defines it; a moved public "
                       f"name goes in megatron_pack/_deprecated.py): {found}")


def test_documented_package_holds_only_documented_names():
    source = (ROOT / "megatron_pack/config/__init__.py").read_text(encoding="utf-8")
    held = {u.split(": ")[1] for u in unused_imports(source)}
    assert held == DOCUMENTED_PACKAGE["megatron_pack/config/__init__.py"]


def _table_imports(source: str) -> list[str]:
    """Imports of a moved path: ``from <old module> import <name>`` or of an old module itself."""
    old_modules = set(_deprecated.OLD_MODULES)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in _deprecated.MOVED or node.module in old_modules \
                        or f"{node.module}.{alias.name}" in old_modules:
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in old_modules]
    return found


def test_nothing_imports_through_the_table():
    assert _table_imports("from megatron_pack.data.thd import collate_thd\nimport megatron_pack.data.in_batch\n"
                          "from megatron_pack.parallel.cp import pad_multiple, slice_thd_batch\n") == [
        "1: from megatron_pack.data.thd import collate_thd", "2: import megatron_pack.data.in_batch",
        "3: from megatron_pack.parallel.cp import pad_multiple"]  # the check finds each form
    files = [f for d in ("megatron_pack", "tests", "bench", "scripts") for f in sorted((ROOT / d).rglob("*.py"))
             if f.resolve() != pathlib.Path(__file__).resolve()]
    assert len(files) > 150
    found = [f"{f.relative_to(ROOT)}:{hit}" for f in files for hit in _table_imports(f.read_text(encoding="utf-8"))]
    assert not found, f"import these from the module the name lives in (megatron_pack/_deprecated.py MOVED): {found}"
