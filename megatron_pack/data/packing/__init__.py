"""Packing: algorithms (``algorithms``), the per-sample rules (``rules``), the epoch order
(``order``), plans on disk (``plan``), length buckets (``buckets``), split pieces (``split``), the
wrapped stream (``wrapped``), source mixing (``mixing``), the plan report (``report``), the
Megatron-Bridge export (``bridge``), online packing from a bounded buffer (``online``), and the
assignment of packs to data-parallel ranks by cost (``balance``).

``megatron_pack.data.packing.plan_packing`` (public) and the other names of the algorithms
module are re-exported here.
"""

from megatron_pack.data.packing.algorithms import (  # noqa: F401
    ALGORITHMS, BIN_PACKING_ALGORITHMS, SMALL_PLAN, thd_lengths, PackingPlan, best_fit_decreasing, lower_bound_bins,
    plan_packing,
)

__all__ = ['ALGORITHMS', 'BIN_PACKING_ALGORITHMS', 'SMALL_PLAN', 'thd_lengths', 'PackingPlan', 'best_fit_decreasing',
           'lower_bound_bins', 'plan_packing']
