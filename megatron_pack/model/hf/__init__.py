"""Hugging Face models in and out: config.json -> ``model.*``, safetensors <-> megatron-core shards.

* ``megatron_pack.config.hf_config``: one torch-free record per family (model type, architectures,
  the ``model.*`` keys it fixes, the config.json keys it refuses, its name rules), config.json ->
  ``model.*`` (in the config layer because ``load_config`` refuses an unsupported folder before launch);
* ``transforms``: each layout (replicated, row, vocab, qkv, gate_up) a class registered by name;
* ``rules``: a family's rules applied to one model chunk (``Placement``: a pipeline stage's layers,
  an expert-parallel rank's experts) and the HF shapes they imply (torch-free);
* ``mapping``: a rule's transform on its split axis (TP, or expert TP), both directions;
* ``load``: streamed, TP-sliced loading (``safe_open`` + ``get_slice``);
* ``export``: a checkpoint (any TP/CP/DP) or a pretrained folder -> a Hugging Face folder.

Importing this package does not import torch; import the submodules.
"""
