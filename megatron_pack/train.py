"""`python -m megatron_pack.train key=value ...`: the same entry as `megatron-pack train`."""

import sys

from megatron_pack.cli.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
