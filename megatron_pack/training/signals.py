"""Save on a signal: every rank finishes its step, the run saves a checkpoint, every rank exits 0.

With ``checkpoint.save_on_signal=true`` (the default) the signals ``checkpoint.signals`` (SIGTERM,
SIGUSR1) only record that a stop was asked for. After each step every rank enters one tiny
all-reduce (MAX over the world, one int64) of the signal it received (0: none), so all ranks
agree, whichever got the signal: a SLURM preemption signals every process, ``kill`` one rank, a
launch script the workers of its node. Then all of them save together (unless that step was just
saved), rank 0 prints ``stopped by SIGTERM after step 7: saved checkpoint ...``, and the run ends
as a finished one does (exit 0). Running the same command resumes at step 8 with the losses an
uninterrupted run has (tests/functional/test_signals.py).

SIGINT (Ctrl-C) is one of the default stop signals: the launch script's guard passes it to the workers
(``cli.launch``) and exits 130 once they have saved. The handlers are installed at the start of the worker
(``install``; before the config is read, for the default signals) and kept to the end: a second signal
while saving changes nothing, except a second SIGINT, which ends the process at once (a second Ctrl-C of a
run started without the launch scripts; under them the guard kills the whole tree). A signal not
configured keeps its default action.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from megatron_pack.config.choices import STOP_SIGNALS

_received: list[int] = []
_installed: set[int] = set()


def _record(signum: int, _frame) -> None:
    if signum == signal.SIGINT and signum in _received:  # Ctrl-C twice: stop now, nothing more saved
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if signum not in _received:
        _received.append(signum)


def install(names: tuple[str, ...] | list[str]) -> None:
    """Record (instead of act on) the signals ``names``."""
    for name in names:
        num = int(getattr(signal, name))
        signal.signal(num, _record)
        _installed.add(num)


def take_back_ignored(names: str) -> None:
    """A worker's start (``cli.launch.worker_started``): the comma-separated signals torchrun was told
    to ignore, and so passed on ignored, are recorded until ``configure`` decides."""
    install([n for n in names.split(",") if n in STOP_SIGNALS])


def configure(save_on_signal: bool, names: list[str]) -> None:
    """Keep recording ``names`` when ``save_on_signal``; give every other installed signal its default
    action back (re-raising it if it already arrived, as it would have acted)."""
    _problems.clear()  # a new run (several run in one process in the tests' torchrun world)
    wanted = {int(getattr(signal, n)) for n in names} if save_on_signal else set()
    install([signal.Signals(n).name for n in wanted])
    for num in sorted(_installed - wanted):
        signal.signal(num, signal.default_int_handler if num == signal.SIGINT else signal.SIG_DFL)
        _installed.discard(num)
        if num in _received:
            _received.remove(num)
            os.kill(os.getpid(), num)


DATA_STOP = 1000
"""What a rank that read data it cannot train on enters in the stop all-reduce: above every signal number, so the
MAX names it whatever signal another rank got."""
DATA_STOP_NAME = "a data problem"
_problems: list[str] = []


def stop_for_data(message: str) -> None:
    """Stop the run after this step as a stop signal does (checkpoint saved), for data this rank cannot train on:
    an image changed or deleted since prepare (``data.batches.vlm.DATA_PROBLEM``); ``message`` names it and the fix."""
    if not _problems:
        _problems.append(message)


def data_problem() -> Optional[str]:
    """The data problem this process stopped for (``stop_for_data``), or None."""
    return _problems[0] if _problems else None


def received() -> int:
    """The first stop signal this process received (0: none; ``DATA_STOP`` for a data problem)."""
    if _problems:
        return DATA_STOP
    return _received[0] if _received else 0


class StopRequest:
    """After each step: did any rank receive a stop signal? The same answer on every rank."""

    def __init__(self, enabled: bool, device):
        self.enabled = enabled
        self.device = device

    def agreed(self) -> Optional[str]:
        """The stop signal's name when any rank received one (``DATA_STOP_NAME`` when a rank read data it cannot
        train on), else None. A collective over the world every step, also with ``save_on_signal`` off (then only a
        data problem can stop the run: the signals keep their default action)."""
        import torch

        from megatron_pack.parallel.comm import all_reduce

        mine = received() if self.enabled or _problems else 0
        flag = torch.tensor([mine], dtype=torch.int64, device=self.device)
        all_reduce(flag, op="max")
        value = int(flag.item())
        if value == DATA_STOP:
            return DATA_STOP_NAME
        return signal.Signals(value).name if value else None
