"""Data: raw records -> token store -> packing plan -> THD batches, one sub-package per step.

- ``formats``  sources (JSONL / Parquet / synthetic), record schemas, tokenizers and chat
- ``store``    the token store, the metadata format of a prepared dataset, atomic writes
- ``packing``  packing algorithms, plans on disk, the plan report, the Megatron-Bridge export
- ``batches``  the packed dataset, THD collate, in-batch packing, sampler, the loader from config

``prepare`` runs the offline steps (``megatron-pack prepare``); see docs/data.md. The flat module
paths of earlier releases (``megatron_pack.data.thd``, ``.dataset``, ``.store``, ...) still
import and re-export the same objects. Submodules are imported on use so ``import
megatron_pack.data`` stays light.
"""
