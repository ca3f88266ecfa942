"""megatron_pack: packed-sequence SFT in the THD layout with context parallelism, on megatron-core."""

__version__ = "0.1.0"
