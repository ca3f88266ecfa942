"""Run several ``megatron-pack train`` command lines in one torchrun world (tests only).

    torchrun --standalone --nproc-per-node 2 tests/functional/_train_cases.py cases.json

``cases.json`` is ``[[name, [key=value, ...]], ...]``. Every rank runs each case through the train
entry (``megatron_pack.cli.train.main``, as ``megatron-pack train`` does), which makes and destroys the
process groups; each case rendezvouses under its own prefix (the prefix the entry takes from
``TORCHELASTIC_RESTART_COUNT``), so the groups of one case never meet the keys of the one before.
The start-up (interpreters, imports, the agent) is paid once for all cases. Before each case the first
rank prints ``CASE_MARK`` and the case's name on stdout, so a caller can split the output per case
(``tests/_hf.py torchrun_train_cases``).
"""

import json
import os
import sys

from megatron_pack.cli.main import warn_once_on_rank_0

CASE_MARK = "=== _train_cases.py case: "

if __name__ == "__main__":
    warn_once_on_rank_0()
    from megatron_pack.cli.train import main

    for i, (name, argv) in enumerate(json.loads(open(sys.argv[1]).read())):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = f"case{i}"
        if os.environ.get("RANK", "0") == "0":
            print(f"{CASE_MARK}{name}", flush=True)
        status = main(argv)
        if status:
            print(f"case {name}: megatron-pack train exited {status}", file=sys.stderr, flush=True)
            sys.exit(status)
