"""Config: one read-only dataclass per group, Hydra composition, cross-group validation.

    >>> from megatron_pack.config import load_config
    >>> cfg = load_config(["data=synthetic", "parallel=cp2"])
    >>> cfg.parallel.context_parallel_size
    2
"""

from megatron_pack.config.loader import load_config
from megatron_pack.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DDPConfig,
    ExportConfig,
    LoggingConfig,
    ModelConfig,
    PackingConfig,
    ParallelConfig,
    TrainConfig,
    VerifyConfig,
)
from megatron_pack.config.validate import validate

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DDPConfig", "ExportConfig", "LoggingConfig",
    "ModelConfig", "PackingConfig", "ParallelConfig", "TrainConfig", "VerifyConfig", "load_config", "validate",
]
