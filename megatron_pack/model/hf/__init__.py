"""Hugging Face models in and out: config.json -> ``model.*``, safetensors <-> megatron-core shards.

* ``megatron_pack.config.hf_config``: the supported families, the refusals, config.json -> ``model.*``
  (in the config layer because ``load_config`` refuses an unsupported folder before launch);
* ``mapping``: one table per family (HF name <-> megatron-core name + transform), both directions;
* ``load``: streamed, TP-sliced loading (``safe_open`` + ``get_slice``);
* ``export``: a checkpoint (any TP/CP/DP) or a pretrained folder -> a Hugging Face folder.

Importing this package does not import torch; import the submodules.
"""

from megatron_pack.config.hf_config import (
    ARCH_KEYS,
    SUPPORTED_FAMILIES,
    UnsupportedModel,
    derive_model_keys,
    pretrained_model_keys,
    refusal,
)

__all__ = ["ARCH_KEYS", "SUPPORTED_FAMILIES", "UnsupportedModel", "derive_model_keys", "pretrained_model_keys",
           "refusal"]
