"""Config: one read-only dataclass per group, Hydra composition, cross-group validation.

    >>> from megatron_pack.config import load_config
    >>> cfg = load_config(["data=synthetic", "parallel=cp2"])
    >>> cfg.parallel.context_parallel_size
    2
"""

from megatron_pack.config.loader import config_dir, config_to_yaml, load_config
from megatron_pack.config.schema import (
    GROUPS,
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
from megatron_pack.config.validate import effective_pad_multiple, validate

__all__ = [
    "GROUPS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DDPConfig", "ExportConfig", "LoggingConfig",
    "ModelConfig", "PackingConfig", "ParallelConfig", "TrainConfig", "VerifyConfig",
    "config_dir", "config_to_yaml", "effective_pad_multiple", "load_config", "validate",
]
