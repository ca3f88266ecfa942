"""The parallel layout: ``ParallelDims`` (degrees, torch-free, here), ``groups.ParallelState`` (the
degrees plus this process's ranks and groups, built once by ``groups.initialize_parallel``) and
context-parallel slicing (``cp``)."""
