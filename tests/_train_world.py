"""One torchrun world of 2 ranks per test process, started at its first use, that runs the ``megatron-pack``
commands tests would otherwise launch each under a torchrun of their own (issue 33 item 2).

    from _train_world import run_in_world

    outputs = run_in_world(root, {"ep2": ["train", *args], "check": ["verify", *more]})   # name -> output

Each command is what ``torchrun --standalone --nproc-per-node 2 -m megatron_pack.cli.main COMMAND ARGS`` (or
``-m megatron_pack.train ARGS``) runs, in ``root``, on the two ranks of the world (``tests/functional/
_train_cases.py --serve``): the console script's function, with its own process groups made and destroyed. What
changes is what a torchrun start costs (about 12 CPU-s for the agent and two ranks importing torch and
megatron-core, and the first run's warm-up) once per test process instead of once per command: cases of every
module share it. The output of a command is its two ranks' stdout and stderr (rank 0's, then rank 1's). A
command that exits non-zero fails the call (``expect`` says otherwise); a world that does not answer within
``timeout`` is killed, the call fails with every rank's Python stack, and the next call starts a new world.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVER = Path(__file__).resolve().parent / "functional" / "_train_cases.py"
NPROC = 2


class _World:
    def __init__(self) -> None:
        self.spool = tempfile.mkdtemp(prefix="train_world_")
        self.log = open(os.path.join(self.spool, "torchrun.log"), "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
               "MEGATRON_PACK_TEST_CLIENT_PID": str(os.getpid())}
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
             "--monitor-interval", "1", str(SERVER), "--serve", self.spool],
            cwd=self.spool, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.jobs = 0
        self.history: list[str] = []

    def run(self, root: Path, commands: dict[str, list[str]], env: dict, timeout: float) -> list:
        job = self.jobs
        self.jobs += 1
        spec = {"cwd": str(root), "env": env, "timeout": timeout, "cases": [[n, list(c)] for n, c in commands.items()]}
        path = os.path.join(self.spool, f"job{job}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(spec, f)
        os.replace(path + ".tmp", path)
        done = [os.path.join(self.spool, f"job{job}.rank{r}.json") for r in range(NPROC)]
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(d) for d in done):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                what = "ended" if self.proc.poll() is not None else "hung"
                time.sleep(2.0)  # the stacks a rank writes at the deadline
                report = self._report(job, commands)
                self.stop(kill=True)
                raise AssertionError(f"the train world {what} in job {job} ({list(commands)}):\n{report}")
            time.sleep(0.05)
        statuses = [json.loads(Path(d).read_text()) for d in done]
        outputs = {}
        for i, name in enumerate(commands):
            outputs[name] = ([s[i] for s in statuses], "".join(self._read(f"job{job}.{i}.rank{r}.log")
                                                               for r in range(NPROC)))
            self.history.append(outputs[name][1])
        return outputs

    def _read(self, name: str) -> str:
        """A file of the spool, ending with a newline unless empty (so one log never runs into the next)."""
        path = os.path.join(self.spool, name)
        text = Path(path).read_text(errors="replace") if os.path.exists(path) else ""
        return text if not text or text.endswith("\n") else text + "\n"

    def _report(self, job: int, commands: dict) -> str:
        parts = [f"--- {name}, rank {r} ---\n{self._read(f'job{job}.{i}.rank{r}.log')[-4000:]}"
                 for i, name in enumerate(commands) for r in range(NPROC)]
        parts += [f"--- rank {r}'s stack ---\n{self._read(f'job{job}.rank{r}.stacks')}" for r in range(NPROC)]
        self.log.flush()
        return "\n".join(parts + [f"--- torchrun ---\n{self._read('torchrun.log')[-3000:]}"])

    def stop(self, *, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if not kill:
                Path(self.spool, "stop").touch()
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    kill = True
            if kill:
                with contextlib.suppress(ProcessLookupError):  # the world ended meanwhile
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.spool, ignore_errors=True)


_WORLD: list[_World] = []


def _stop_world() -> None:
    while _WORLD:
        _WORLD.pop().stop()


atexit.register(_stop_world)


def pids() -> list[int]:
    """The live world's processes: the torchrun agent and its ranks (for the suite's CPU meter, tests/conftest.py)."""
    if not _WORLD or _WORLD[0].proc.poll() is not None:
        return []
    agent, ranks = _WORLD[0].proc.pid, []
    for task in Path(f"/proc/{agent}/task").glob("*"):
        try:
            ranks += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return [agent, *ranks]


def world_output() -> str:
    """Everything the commands run on the current world printed, in order: what a check of once-per-process output
    (a warning said once) reads, since the commands of earlier tests ran in the same processes."""
    return "".join(_WORLD[0].history) if _WORLD else ""


def run_in_world(root: Path | str, commands: dict[str, list[str]], *, env: dict | None = None, timeout: float = 600,
                 expect: int = 0) -> dict[str, str]:
    """Run ``commands`` (name -> ``megatron-pack`` command line) in order on the session's world of 2 ranks, in
    ``root`` with ``env`` added; every one must exit ``expect`` on both ranks. Returns name -> output."""
    if not _WORLD:
        _WORLD.append(_World())
    try:
        results = _WORLD[0].run(Path(root), commands, {k: str(v) for k, v in (env or {}).items()}, timeout)
    except AssertionError:
        _WORLD.clear()
        raise
    for name, (statuses, output) in results.items():
        assert statuses == [expect] * NPROC, f"{name}: `megatron-pack {' '.join(commands[name])}` exited {statuses}:\n" \
                                             f"{output[-6000:]}"
    return {name: output for name, (_, output) in results.items()}


def run_losses(root: Path | str, run: str) -> list[float]:
    """The ``lm_loss`` of each step of ``runs/<run>/metrics.jsonl`` under ``root``, in order."""
    lines = (Path(root) / f"runs/{run}/metrics.jsonl").read_text().splitlines()
    return [m["lm_loss"] for m in map(json.loads, lines) if "lm_loss" in m]


def last_checkpoint_weights(root: Path | str, run: str, step: int) -> dict:
    """The full model of ``runs/<run>``'s last checkpoint, which must be the one of ``step``."""
    from megatron_pack.training.checkpoint import read_full_model

    steps = sorted((Path(root) / f"runs/{run}/checkpoints").glob("step_*"))
    assert steps and steps[-1].name == f"step_{step:08d}", steps
    return read_full_model(steps[-1])
