"""The one table of public names whose documented path is not where they live (DESIGN.md "Public surface").

Each entry resolves its old path to the very object at the new one and warns once per use with a
``DeprecationWarning`` naming the new path. Nothing else is re-exported anywhere in the package,
and the package's own code and tests import from the real modules (tests/unit/test_one_home.py).

* ``megatron_pack.data.packing`` and ``megatron_pack.parallel.cp`` are real modules: their
  module-level ``__getattr__`` (PEP 562) is :func:`module_getattr`, consulted only for names they
  do not define.
* ``megatron_pack.data.thd`` and ``megatron_pack.data.in_batch`` are no longer files: importing
  ``megatron_pack.data`` registers each as a module object holding nothing but that
  ``__getattr__`` (:func:`register_old_modules`), so ``from megatron_pack.data.thd import
  collate_thd`` still works. No import hook is installed.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings

MOVED = {
    "megatron_pack.data.thd.collate_thd": "megatron_pack.data.batches.thd.collate_thd",
    "megatron_pack.data.in_batch.pack_batch_sequences": "megatron_pack.data.batches.in_batch.pack_batch_sequences",
    "megatron_pack.data.packing.plan_packing": "megatron_pack.data.packing.algorithms.plan_packing",
    "megatron_pack.parallel.cp.pad_multiple": "megatron_pack.config.layout.pad_multiple",
}
"""Documented path -> where the name lives now (one entry per public name that moved)."""

OLD_MODULES = ("megatron_pack.data.thd", "megatron_pack.data.in_batch")
"""Documented module paths that are no longer files (each holds only its entries of ``MOVED``)."""


def resolve(old: str):
    """The object ``old`` (a key of ``MOVED``) names, with a DeprecationWarning naming its path now."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; import it from {new.rpartition('.')[0]}", DeprecationWarning, stacklevel=3)
    module, _, name = new.rpartition(".")
    return getattr(importlib.import_module(module), name)


def module_getattr(module: str):
    """A PEP 562 ``__getattr__`` for ``module``: its entries of ``MOVED``, else AttributeError."""

    def __getattr__(name: str):
        if f"{module}.{name}" in MOVED:
            return resolve(f"{module}.{name}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def register_old_modules(package: types.ModuleType) -> None:
    """Register ``OLD_MODULES`` under ``package`` as modules whose only names are their table entries."""
    for path in OLD_MODULES:
        parent, _, child = path.rpartition(".")
        if parent != package.__name__ or path in sys.modules:
            continue
        module = types.ModuleType(path, f"Moved: {', '.join(k for k in MOVED if k.startswith(path + '.'))} "
                                        "(see megatron_pack._deprecated).")
        module.__getattr__ = module_getattr(path)
        sys.modules[path] = module
        setattr(package, child, module)
