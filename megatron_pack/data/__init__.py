"""Data: raw records -> token store -> packing plan -> THD batches, one sub-package per step.

- ``formats``  sources (JSONL / Parquet / synthetic), record schemas, tokenizers and chat
- ``store``    the token store, the metadata format of a prepared dataset, atomic writes
- ``packing``  packing algorithms, plans on disk, the plan report, the Megatron-Bridge export
- ``batches``  the packed dataset, THD collate, in-batch packing, sampler, the loader from config

``prepare`` runs the offline steps (``megatron-pack prepare``); see docs/data.md. Submodules are
imported on use so ``import megatron_pack.data`` stays light.

``megatron_pack.data.thd`` and ``megatron_pack.data.in_batch`` (DESIGN.md's paths of
``collate_thd`` and ``pack_batch_sequences``, now in ``batches``) resolve through the one table of
moved public names, ``megatron_pack._deprecated``, with a DeprecationWarning.
"""

import sys

from megatron_pack import _deprecated

_deprecated.register_old_modules(sys.modules[__name__])
