"""`python -m megatron_pack.train key=value ...`: the same entry as `megatron-pack train`."""

import sys

from megatron_pack.cli.main import warn_once_on_rank_0

if __name__ == "__main__":
    warn_once_on_rank_0()  # before megatron-core is imported: it warns at import time
    from megatron_pack.cli.train import main

    sys.exit(main(sys.argv[1:]))
