"""Old import path of ``megatron_pack.data.packing.report`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.packing.report import (  # noqa: F401
    report_numbers, write_report,
)

__all__ = ['report_numbers', 'write_report']
