"""Parallel layout (``ParallelDims``), process groups and context-parallel slicing."""

from megatron_pack.parallel.dims import ParallelDims, effective_pad_multiple

__all__ = ["ParallelDims", "effective_pad_multiple"]
