"""What the launch scripts run around torchrun, and what each worker does first (torch-free).

``launch/*.sh`` end in ``exec python -m megatron_pack.cli.launch torchrun <torchrun args>``: the
script's process becomes this guard, which starts torchrun as its child and stays until torchrun
ends, with its exit status. It owns the process tree:

- **no orphans**: torchrun gets ``PR_SET_PDEATHSIG=SIGKILL`` (it dies with the guard, even by
  ``kill -9``) and each worker sets the same for torchrun (``worker_started``), so no worker outlives
  its launcher (torchrun itself starts every worker in a session of its own, out of reach of a
  process-group kill);
- **signals**: SIGTERM, SIGUSR1, SIGUSR2 and SIGINT (Ctrl-C) go to the workers themselves, which finish
  the step, save and exit 0 (``checkpoint.save_on_signal``, ``training.signals``); torchrun ignores them, so
  it sees its workers end well and exits 0 too, and the guard exits 0, or 130 after a Ctrl-C (the shell's
  code for a run stopped by SIGINT). SIGHUP goes to torchrun, which stops the workers as it always does.
  A second signal (a second Ctrl-C) kills torchrun at once (and so every worker): nothing more is saved. Under SLURM, ``--signal=USR1@120`` and the time limit's SIGTERM reach every
  process of the step; the guard forwards again, which changes nothing.

``python -m megatron_pack.cli.launch backend [key=value ...]`` prints ``nccl`` or ``gloo`` without importing torch
(``common.sh``): the backend of the config those overrides load (presets included: ``experiment=vlm_tiny`` sets
``train.device: cpu``) on this host, decided by the rule ``ParallelState`` follows (``config.device.run_backend``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

from megatron_pack.config.host import gpu_visible

WORKER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
"""Signals the guard sends to the workers themselves (torchrun ignores them)."""
AGENT_SIGNALS = (signal.SIGHUP,)
"""Signals the guard passes to torchrun, which stops its workers its own way."""
IGNORED_ENV = "MEGATRON_PACK_IGNORED_SIGNALS"
"""Names of the signals torchrun ignores for the guard; a worker inherits that and undoes it."""
GUARD_ENV = "MEGATRON_PACK_GUARD_PID"
"""The guard's pid: a worker's parent (torchrun) must be the guard's child, else the worker is an orphan."""
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def worker_started() -> None:
    """First thing a worker does under torchrun: die with its agent, and take back the stop signals.

    Outside torchrun (no ``TORCHELASTIC_RUN_ID``) it does nothing. A worker whose agent already died
    (it was re-parented) exits at once."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    if set_parent_death_signal(signal.SIGKILL):  # from here on; a torchrun already gone is checked below
        guard = os.environ.get(GUARD_ENV)
        parent = os.getppid()
        if parent == 1 or (guard is not None and _parent_of(parent) != int(guard)):
            os._exit(1)  # torchrun died before this worker asked to die with it: re-parented
    from megatron_pack.training.signals import take_back_ignored

    take_back_ignored(os.environ.get(IGNORED_ENV, ""))


def _parent_of(pid: int) -> Optional[int]:
    """The parent pid of ``pid`` from /proc (None when it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (its workers, for torchrun), from /proc."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


class Guard:
    """torchrun as a child of this process, with the signal routing of the module docstring."""

    def __init__(self, torchrun_args: list[str]):
        self.proc: Optional[subprocess.Popen] = None
        self.args = torchrun_args
        self.stops = 0
        self.interrupted = False
        """The stop was a Ctrl-C (SIGINT): the guard exits 130 once the workers have saved."""

    def _in_child(self) -> None:
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != self.guard_pid:
            os._exit(1)
        for sig in WORKER_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _forward(self, signum: int, _frame) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.stops += 1
        if self.stops > 1:  # asked twice: stop now; the workers die with torchrun (their death signal)
            self.proc.kill()
            return
        self.interrupted = signum == signal.SIGINT
        if signum in AGENT_SIGNALS:
            self.proc.send_signal(signum)
            return
        for pid in _children(self.proc.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        self.guard_pid = os.getpid()
        for sig in WORKER_SIGNALS + AGENT_SIGNALS:
            signal.signal(sig, self._forward)
        env = {**os.environ, IGNORED_ENV: ",".join(s.name for s in WORKER_SIGNALS), GUARD_ENV: str(self.guard_pid)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--signals-to-handle",
               ",".join(s.name for s in AGENT_SIGNALS), *self.args]
        # its own process group: a terminal's Ctrl-C reaches the guard, which passes it on once
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=self._in_child, process_group=0)
        while True:
            try:
                code = self.proc.wait()
                break
            except InterruptedError:
                continue
        if code == 0 and self.interrupted:
            return 128 + signal.SIGINT  # 130: stopped by Ctrl-C, its checkpoint saved
        return code if code >= 0 else 128 - code


def hide_gpus_for_cpu_run(device: str) -> None:
    """``train.device=cpu``: this process (and its children) will not see a GPU, so torch, megatron-core
    and ``initialize_parallel`` all compute and communicate on the CPU (gloo). Called by the entry points
    once the config is loaded, before anything starts CUDA."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def launch_backend(overrides: list[str]) -> str:
    """The ``parallel.backend`` the launch scripts pass: the composed config's (``train.device`` and
    ``parallel.backend``, a preset's values included) on this host, by ``config.device.run_backend``, the rule
    ``ParallelState`` follows. The config is composed, not validated, and without reading ``model.pretrained``
    (the device does not depend on it); one that does not compose answers gloo, and the run it launches
    refuses it in one line."""
    from megatron_pack.config.device import run_backend
    from megatron_pack.config.loader import compose_config

    given = [arg for arg in overrides if not arg.startswith("-")]
    try:
        cfg = compose_config(given + ["model.pretrained=null"])
    except ValueError:  # ConfigError, or Hydra's override errors: the train entry reports them
        return "gloo"
    return run_backend(cfg.train.device, cfg.parallel.backend, gpu_present=gpu_visible())[1]


def main(argv: list[str]) -> int:
    if argv[:1] == ["backend"]:
        print(launch_backend(argv[1:]))
        return 0
    if argv[:1] == ["torchrun"]:
        return Guard(argv[1:]).run()
    print("usage: python -m megatron_pack.cli.launch backend [key=value ...] | torchrun <torchrun arguments>",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
