"""Data: raw records -> token store -> packing plan -> THD batches, one sub-package per step.

- ``formats``  sources (JSONL / Parquet / synthetic), record schemas, tokenizers and chat
- ``store``    the token store, the metadata format of a prepared dataset, atomic writes
- ``packing``  packing algorithms, plans on disk, the plan report, the Megatron-Bridge export
- ``batches``  the packed dataset, THD collate, in-batch packing, sampler, the loader from config

``prepare`` runs the offline steps (``megatron-pack prepare``); see docs/data.md. Submodules are
imported on use so ``import megatron_pack.data`` stays light.

The flat module paths of earlier releases (``megatron_pack.data.thd``, ``.dataset``, ``.plan``,
...) still import: ``OLD_PATHS`` maps each to its new module, and importing the old name gives
that very module object (so ``megatron_pack.data.thd.collate_thd`` is
``megatron_pack.data.batches.thd.collate_thd``, and patching one patches the other). They are
aliases rather than files so that version control sees each move as a rename.
``megatron_pack.data.store`` and ``megatron_pack.data.packing`` are packages now; they re-export
the names of the token store and of the packing algorithms.
"""

import importlib
import importlib.abc
import importlib.util
import sys

OLD_PATHS = {
    "sources": "formats.sources", "tokenizer": "formats.tokenizer", "synthetic": "formats.synthetic",
    "atomic": "store.atomic",
    "plan": "packing.plan", "report": "packing.report", "bridge": "packing.bridge",
    "dataset": "batches.dataset", "thd": "batches.thd", "in_batch": "batches.in_batch", "sampler": "batches.sampler",
}
"""Old module name under ``megatron_pack.data`` -> its module now (relative to ``megatron_pack.data``)."""


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``megatron_pack.data.<old>`` as the module it moved to (the same object, imported on use)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package == __name__ and old in OLD_PATHS:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.{OLD_PATHS[spec.name.rpartition('.')[2]]}")

    def exec_module(self, module):
        pass  # already executed under its new name


if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
    sys.meta_path.append(_OldPathFinder())
