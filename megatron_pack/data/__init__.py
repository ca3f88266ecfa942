"""Data: tokenization into a token store, packing plans, the packed dataset, THD collate.

Offline pipeline (``megatron-pack prepare``): ``sources`` -> ``tokenizer`` -> ``store`` ->
``packing`` / ``plan`` -> ``dataset.PackedSFTDataset``; see docs/data.md. Submodules are
imported on use so ``import megatron_pack.data`` stays light.
"""
