"""Old import path of ``megatron_pack.data.batches.dataset`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.batches.dataset import (  # noqa: F401
    PackedSFTDataset,
)

from megatron_pack.data.store.metadata import (  # noqa: F401  (defined here before the split)
    check_tokenizer, list_plans, read_metadata, verify_files,
)

__all__ = ['check_tokenizer', 'list_plans', 'read_metadata', 'verify_files', 'PackedSFTDataset']
