"""Old import path of ``megatron_pack.data.batches.in_batch`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.batches.in_batch import (  # noqa: F401
    IGNORE_INDEX, pack_batch_sequences,
)

__all__ = ['IGNORE_INDEX', 'pack_batch_sequences']
