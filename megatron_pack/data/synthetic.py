"""Old import path of ``megatron_pack.data.formats.synthetic`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.formats.synthetic import (  # noqa: F401
    TASKS, GENERATOR_VERSION, synthetic_record, synthetic_records,
)

__all__ = ['TASKS', 'GENERATOR_VERSION', 'synthetic_record', 'synthetic_records']
