"""Run ``megatron-pack`` commands in one torchrun world (tests only): the start-up (interpreters, imports, the
agent) is paid once for all of them.

    torchrun --standalone --nproc-per-node 2 tests/functional/_train_cases.py cases.json
    torchrun --standalone --nproc-per-node 2 tests/functional/_train_cases.py --serve SPOOL

``cases.json`` is ``[[name, [key=value, ...]], ...]``: every rank runs each case through the train entry
(``megatron_pack.cli.train.main``, as ``megatron-pack train`` does), in order, and the world exits at the first
that fails. Before each case the first rank prints ``CASE_MARK`` and the case's name on stdout, so a caller can
split the output per case.

``--serve SPOOL``: the world of a whole test session (``tests/_train_world.py``, which starts it and writes the
jobs). Every rank waits for ``SPOOL/job<n>.json`` (n = 0, 1, ...): ``{"cwd", "env", "timeout", "cases": [[name,
[command, args...]], ...]}``, each case one ``megatron-pack`` command line (``train ...``, ``verify ...``) run
through the subcommand's function (what ``megatron_pack.cli.main.main`` calls) in ``cwd`` with ``env`` added, its output
(the rank's stdout and stderr) in ``SPOOL/job<n>.<i>.rank<r>.log``. Every case runs, whatever the ones before
returned; the rank then writes ``SPOOL/job<n>.rank<r>.json`` (each case's exit status, or ``"raised"`` with the
traceback in its log). A rank still in a job ``timeout`` seconds after it began writes its Python stack to
``SPOOL/job<n>.rank<r>.stacks`` (the caller then ends the world). ``SPOOL/stop``, or the test process
(``MEGATRON_PACK_TEST_CLIENT_PID``) gone, ends the world.

Each case makes and destroys its own process groups; it rendezvouses under its own prefix (the prefix the train
entry takes from ``TORCHELASTIC_RESTART_COUNT``), so the groups of one case never meet the keys of the one before.
"""

import faulthandler
import json
import os
import sys
import time
import traceback

from megatron_pack.cli.main import warn_once_on_rank_0
from megatron_pack.data.store.atomic import _pid_alive as _alive

CASE_MARK = "=== _train_cases.py case: "
CLIENT_ENV = "MEGATRON_PACK_TEST_CLIENT_PID"
POLL_S = 0.05


def _wait_for(path: str, spool: str, client: int) -> bool:
    """True when ``path`` is there; False when the world is to end."""
    while not os.path.exists(path):
        if os.path.exists(os.path.join(spool, "stop")) or not _alive(client):
            return False
        time.sleep(POLL_S)
    return True


def _run_case(argv: list[str], cwd: str, env: dict, log: str):
    """One command line in ``cwd`` with ``env`` added, stdout and stderr (the file descriptors) into ``log``: the
    subcommand's function, as the console script calls it (without installing the once-per-process warning display
    again: every warning of the world is said once, as in one run)."""
    import importlib

    from megatron_pack.cli.main import SUBCOMMANDS

    main = importlib.import_module(SUBCOMMANDS[argv[0]][0]).main
    argv = argv[1:]

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    try:
        os.environ.update(env)
        os.chdir(cwd)
        try:
            return main(list(argv))
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 (reported to the caller, which fails the test)
            traceback.print_exc()
            return "raised"
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        os.close(saved_fds[0])
        os.close(saved_fds[1])
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def serve(spool: str) -> None:
    rank, client = os.environ.get("RANK", "0"), int(os.environ[CLIENT_ENV])
    job = 0
    while _wait_for(os.path.join(spool, f"job{job}.json"), spool, client):
        with open(os.path.join(spool, f"job{job}.json")) as f:
            spec = json.load(f)
        stacks = open(os.path.join(spool, f"job{job}.rank{rank}.stacks"), "w")  # noqa: SIM115 (closed below)
        faulthandler.dump_traceback_later(max(1.0, spec["timeout"] - 10.0), exit=False, file=stacks)
        statuses = []
        for i, (_name, argv) in enumerate(spec["cases"]):
            os.environ["TORCHELASTIC_RESTART_COUNT"] = f"job{job}case{i}"
            statuses.append(_run_case(argv, spec["cwd"], spec["env"], os.path.join(spool, f"job{job}.{i}.rank{rank}.log")))
        faulthandler.cancel_dump_traceback_later()
        stacks.close()
        done = os.path.join(spool, f"job{job}.rank{rank}.json")
        with open(done + ".tmp", "w") as f:
            json.dump(statuses, f)
        os.replace(done + ".tmp", done)
        job += 1


if __name__ == "__main__":
    warn_once_on_rank_0()
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
        sys.exit(0)
    from megatron_pack.cli.train import main

    for i, (name, argv) in enumerate(json.loads(open(sys.argv[1]).read())):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = f"case{i}"
        if os.environ.get("RANK", "0") == "0":
            print(f"{CASE_MARK}{name}", flush=True)
        status = main(argv)
        if status:
            print(f"case {name}: megatron-pack train exited {status}", file=sys.stderr, flush=True)
            sys.exit(status)
