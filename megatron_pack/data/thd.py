"""Old import path of ``megatron_pack.data.batches.thd`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.batches.thd import (  # noqa: F401
    THD_KEYS, collate_thd, make_collate_fn,
)

__all__ = ['THD_KEYS', 'collate_thd', 'make_collate_fn']
