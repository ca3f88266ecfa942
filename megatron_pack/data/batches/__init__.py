"""Packs out: the packed dataset (store + plan), the THD collate, in-batch packing, the one
loader protocol (``protocol``), the step planner and offline loader (``steps``), the online loader,
and the loader built from a config (``loader.open_dataset`` / ``loader.build_loader``)."""
