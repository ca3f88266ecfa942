"""Packs out: the packed dataset (store + plan), the THD collate, in-batch packing, the
resumable sampler and the one loader built from a config (``loader.open_dataset`` /
``loader.build_loader``)."""
