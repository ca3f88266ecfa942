"""Old import path of ``megatron_pack.data.packing.plan`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.packing.plan import (  # noqa: F401
    PLAN_ARRAYS, NUM_OFFENDERS_SHOWN, Selection, select_samples, plan_metadata, write_plan, plan_lengths,
)

from megatron_pack.data.store.metadata import (  # noqa: F401  (defined here before the split)
    PLAN_FORMAT, PLAN_FORMAT_VERSION, PlanSettings,
)

__all__ = ['PLAN_FORMAT', 'PLAN_FORMAT_VERSION', 'PlanSettings', 'PLAN_ARRAYS', 'NUM_OFFENDERS_SHOWN', 'Selection', 'select_samples', 'plan_metadata', 'write_plan', 'plan_lengths']
