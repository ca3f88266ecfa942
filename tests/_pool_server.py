"""Imported once by the fork server of ``tests/_dist.py``'s pooled ranks (``_start_fork_server``): what every rank
would import first (``_dist._preimport``: torch, megatron-core with its fused kernels left eager on a CPU host, the
training loop), so a new rank is a fork of a process that has it all. The caller's ``PYTHONPATH`` is put back."""

import os

from _dist import SERVER_PYTHONPATH_WAS, UNSET, _preimport

_was = os.environ.pop(SERVER_PYTHONPATH_WAS, None)
if _was == UNSET:
    os.environ.pop("PYTHONPATH", None)
elif _was is not None:
    os.environ["PYTHONPATH"] = _was
_preimport()
