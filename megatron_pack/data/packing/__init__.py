"""Packing: algorithms (``algorithms``), the per-sample rules (``rules``), the epoch order
(``order``), plans on disk (``plan``), length buckets (``buckets``), split pieces (``split``), the
wrapped stream (``wrapped``), source mixing (``mixing``), the plan report (``report``), the
Megatron-Bridge export (``bridge``), online packing from a bounded buffer (``online``), and the
assignment of packs to data-parallel ranks by cost (``balance``).

``megatron_pack.data.packing.plan_packing`` (DESIGN.md's path) resolves to
``algorithms.plan_packing`` through the table of moved public names (``megatron_pack._deprecated``).
"""

from megatron_pack._deprecated import module_getattr

__getattr__ = module_getattr(__name__)
