"""Old import path of ``megatron_pack.data.batches.sampler`` (the code lives there); kept so existing imports work."""

from megatron_pack.data.batches.sampler import (  # noqa: F401
    STATE_VERSION, PackSampler, PackLoader, build_pack_loader,
)

__all__ = ['STATE_VERSION', 'PackSampler', 'PackLoader', 'build_pack_loader']
