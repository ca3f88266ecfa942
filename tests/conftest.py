"""Session-wide test setup: ``tests/`` importable (``_dist``, ``_launch``, ...), the cores shared out
under pytest-xdist, and the session's checks on itself (``tests/_session_checks.py``).

Under ``-n N --dist loadgroup`` (``scripts/test.sh``) the tests that start worlds of several processes
(``tests/functional``, the spawn harness's own tests) are one unit of work, ``worlds``, run on one worker one
case at a time with one pool of ranks: two worlds at once on the 2-core CI machine took more CPU and more time
than one after the other (gloo's threads wait by waking up; a world whose peer is descheduled spins), and a
multi-node launch timed out. Every other module, and the functional modules of ``BESIDE_WORLDS`` (one process
at work most of their time), is its own unit, given whole to whichever worker is free (its module-scoped
fixtures built once). The units go out longest first (``_session_checks.MODULE_SECONDS``), ``worlds`` before
all, so the workers finish together.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parent
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

import _session_checks  # noqa: E402

# Hydra's compositions are kept on disk between processes (config/loader.py, ``MEGATRON_PACK_CACHE_DIR``, else
# ~/.cache/megatron_pack): the session keeps its own store in a temporary folder, never the user's home. Set here,
# at the controller's import, so the xdist workers and every command a test starts inherit the same store.
if "MEGATRON_PACK_CACHE_DIR" not in os.environ:
    os.environ["MEGATRON_PACK_CACHE_DIR"] = tempfile.mkdtemp(prefix="megatron-pack-test-store-")
    atexit.register(shutil.rmtree, os.environ["MEGATRON_PACK_CACHE_DIR"], ignore_errors=True)  # by its maker only

REPO = _TESTS_DIR.parent
_DURATIONS: dict[str, float] = {}
"""Seconds per node id, all phases summed (on the controller under xdist, which receives every report)."""
_SNAPSHOT = pytest.StashKey[dict]()


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # a pytest-xdist worker; the controller checks the session


WORLD_MODULES = ("tests/unit/test_dist_harness.py",)
"""Unit modules that start worlds of processes: they run in the ``worlds`` group too."""
BESIDE_WORLDS = (
    "tests/functional/test_docs_commands.py",  # the documents' commands in this process; one torchrun world of 2
    "tests/functional/test_hf_train_export.py",  # transformers and export in this process; two torchrun runs
    "tests/functional/test_slurm.py",  # waits on slurmctld most of its time (26 CPU-s in 100 s)
    "tests/functional/test_vlm_cli.py",  # prepare, train, export and generate, one command at a time
    "tests/functional/test_lora_train_export.py",  # one torchrun world of 2, then exports and peft in this process
    "tests/functional/test_reliability_crash.py",  # one driver process at a time (run 10: 16.8 CPU-s in 18.1 s)
)
"""Functional modules that run beside the worlds, not in their group: measured at about one core or less
(CPU-seconds over wall seconds, ``MEGATRON_PACK_TEST_CPU_LOG``, run 6: 0.92, 0.97, 0.26, 0.99 and 0.98). The worker
running the worlds was the session's critical path (1,186 s busy against the other's 815 in run 6); the last two
moved beside them take about 165 s off it. Run 10 (the session's torchrun world, garbage collections that skip
the imports): 788 s busy against 737; test_reliability_crash (18 s) moved beside them."""


def _group_of(nodeid: str) -> str:
    module = _session_checks.module_of(nodeid)
    if module in BESIDE_WORLDS:
        return module
    return "worlds" if module.startswith("tests/functional/") or module in WORLD_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup``: whole units (``_group_of``) to whichever worker is free, in the order of the collection
    (sorted below; xdist's own loadgroup reads ``xdist_group`` marks through node ids that pytest 9 no longer
    rewrites, and its reordering puts the units with the most items first, not the longest)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems gave

        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """The worlds first, then the longest modules (a stable sort: a module's items keep their order); every xdist
    worker sorts its collection the same way, as xdist requires."""
    def order(item) -> tuple:
        group = _group_of(item.nodeid)
        return (group != "worlds", _session_checks.schedule_order(_session_checks.module_of(item.nodeid)))

    items.sort(key=order)


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_worker(session.config):
        session.config.stash[_SNAPSHOT] = _session_checks.snapshot(REPO)
    if _is_worker(session.config) or not getattr(session.config.option, "numprocesses", None):  # runs tests
        from megatron_pack.model.cpu_compat import eager_jit_fuser_without_cuda

        # before the collection imports megatron-core, as the package's entries do on a CPU host: its fused
        # kernels' torch.compile would import TorchDynamo and Inductor (1.8 s of each worker's collection)
        eager_jit_fuser_without_cuda()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    nodeid = report.nodeid.split("@", 1)[0]  # loadgroup appends @group to the node id
    _DURATIONS[nodeid] = _DURATIONS.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _is_worker(session.config) or _SNAPSHOT not in session.config.stash:
        return
    problems = _session_checks.over_budget(_DURATIONS)
    touched = _session_checks.changes(session.config.stash[_SNAPSHOT], _session_checks.snapshot(REPO))
    if touched:
        problems.append("the tests changed the repository's working folders (runs/, data/), which the README's "
                        "quickstart uses; write under tmp_path instead:\n" + "\n".join(f"    {t}" for t in touched))
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter:
            reporter.write("\n")
        for problem in problems:
            (reporter.write_line if reporter else print)(f"SESSION CHECK FAILED: {problem}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED



class _CpuMeter:
    """CPU-seconds per test item, with ``MEGATRON_PACK_TEST_CPU_LOG=<folder>`` set (off otherwise): this process,
    the children it reaped (subprocesses, torchrun and their workers), the live pooled ranks of ``_dist`` and the
    session's torchrun world of ``_train_world`` (their own and their reaped children's time, read from /proc; the
    fork server that starts the pooled ranks, and their last moments, are not counted), one JSON line per item in
    ``<folder>/cpu-<worker>.jsonl``. On a 2-core machine the suite's wall time is bounded below by its CPU time
    over 2, so this says which items to make cheaper; ``python tests/_session_checks.py cpu <folder>`` sums it
    per module."""

    def __init__(self, folder: str) -> None:
        import os

        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.out = open(Path(folder) / f"cpu-{worker}.jsonl", "a")  # noqa: SIM115 (closed at exit)

    def _ranks(self) -> dict[int, tuple[float, bool]]:
        """{pid: (CPU-s, whether this process reaps it)} of the pooled ranks (children of the pool's fork server) and
        the torchrun world's processes (children of this one)."""
        import os

        dist, world = sys.modules.get("_dist"), sys.modules.get("_train_world")
        ticks, found = os.sysconf("SC_CLK_TCK"), {}
        pids = [(proc.pid, False) for proc in (dist._POOL.processes if dist else [])]
        pids += [(pid, True) for pid in (world.pids() if world else [])]
        for pid, ours in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu = sum(int(f) for f in fields[11:15]) / ticks  # utime stime cutime cstime
            except (OSError, IndexError, ValueError):
                continue  # the rank ended since the pool listed it: its time is in nobody's reading
            found[pid] = (cpu, ours)
        return found

    def reading(self) -> tuple[float, dict[int, tuple[float, bool]]]:
        import resource

        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime, self._ranks()

    def record(self, nodeid: str, wall: float, before: tuple[float, dict[int, float]]) -> None:
        import json

        (base, ranks_before), (now, ranks_now) = before, self.reading()
        # a process of ours that ended was reaped: its whole time is in RUSAGE_CHILDREN, so its time before is taken
        # off; a pooled rank's last moments are in nobody's reading (its parent is the fork server)
        gone = sum(cpu for pid, (cpu, ours) in ranks_before.items() if ours and pid not in ranks_now)
        since = sum(cpu - ranks_before.get(pid, (0.0, ours))[0] for pid, (cpu, ours) in ranks_now.items())
        cpu = now - base - gone + since
        self.out.write(json.dumps({"id": nodeid, "wall": round(wall, 3), "cpu": round(cpu, 3)}) + "\n")
        self.out.flush()


_CPU_METER: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import os
    import time

    folder = os.environ.get("MEGATRON_PACK_TEST_CPU_LOG")
    if not folder:
        yield
        return
    if not _CPU_METER:
        _CPU_METER.append(_CpuMeter(folder))
    meter, started = _CPU_METER[0], time.monotonic()
    before = meter.reading()
    yield
    meter.record(item.nodeid, time.monotonic() - started, before)


_FROZEN_AT: list[str] = [""]


def pytest_runtest_setup(item) -> None:
    """At each module's first item: collect the garbage, then leave every object alive (the imports, the session's
    fixtures) out of later collections (``gc.freeze``). A full collection of a process that has imported torch,
    megatron-core and transformers scans about 400,000 objects (0.2 CPU-s); the code under test collects after
    every layout (``destroy_parallel``), dozens of times in a module that runs the commands in this process. Only a
    module's start: a module's own fixtures are alive until its end, and what is frozen is never collected."""
    import gc

    module = item.nodeid.split("::", 1)[0]
    if module != _FROZEN_AT[0]:
        _FROZEN_AT[0] = module
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def _scratch_working_folder(tmp_path_factory):
    """Every test session (each xdist worker's too) runs in a scratch working folder: no test reads or writes the
    working folder it was started from (a checkout where the README's quickstart left ``runs/`` and ``data/``).
    Paths a config gives relative to the working folder (``train.output_dir=runs/quickstart``,
    ``data.dataset_dir=data/synthetic``) land in the scratch folder; a test that needs a folder of its own still
    makes one (``tmp_path``). The session check above proves it from the outside."""
    import os

    started_in = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("working_folder"))
    try:
        yield
    finally:
        os.chdir(started_in)
