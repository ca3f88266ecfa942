"""`python -m megatron_pack.train key=value ...`: the same entry as `megatron-pack train`."""

import sys

from megatron_pack.cli.main import quiet_optional_backend_warnings
from megatron_pack.cli.train import main

if __name__ == "__main__":
    quiet_optional_backend_warnings()
    sys.exit(main(sys.argv[1:]))
