"""Parallel layout (``ParallelDims``), process groups and context-parallel slicing."""

from megatron_pack.parallel.dims import ParallelDims

__all__ = ["ParallelDims"]
