"""Old import path of ``megatron_pack.data.packing.bridge`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.packing.bridge import (  # noqa: F401
    BRIDGE_FIELDS, ROWS_PER_GROUP, export_bridge,
)

__all__ = ['BRIDGE_FIELDS', 'ROWS_PER_GROUP', 'export_bridge']
