"""The parallel layout: ``ParallelDims`` (degrees, torch-free, here), ``groups.ParallelState`` (the
degrees plus this process's ranks and groups, built once by ``groups.initialize_parallel``) and
context-parallel slicing (``cp``)."""

from megatron_pack.parallel.dims import ParallelDims, effective_pad_multiple

__all__ = ["ParallelDims", "effective_pad_multiple"]
