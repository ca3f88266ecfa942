"""A real SLURM cluster on this machine for functional tests: munged, slurmctld and two slurmd.

Debian's slurm-wlm is built with MULTIPLE_SLURMD, so several slurmd run on one host with
distinct ``NodeName``s and ports and ``NodeAddr=127.0.0.1``; ``proctrack/linuxproc``,
``task/none`` and no cgroups keep it free of systemd. Everything (config, keys, sockets,
spool, state, logs) lives in one temporary folder, handed to every SLURM command through
``SLURM_CONF``. Every daemon is started in the foreground as a child of the test and stopped
by its process id, even when the test fails.

    with SlurmCluster(tmp_path, node_names) as cluster:
        proc = subprocess.run(["sbatch", "--wait", ...], env=cluster.env)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DEBIAN_PACKAGES = ["munge", "slurmctld", "slurmd", "slurm-client"]
BINARIES = ["munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "srun", "squeue", "scancel"]


def binary(name: str) -> str:
    """The path of a SLURM / munge program (the daemons live in /usr/sbin, often not on PATH)."""
    for folder in ("/usr/sbin", "/usr/bin"):
        if Path(folder, name).exists():
            return str(Path(folder, name))
    return shutil.which(name) or name


def ensure_installed() -> None:
    """Install the Debian packages when a binary is missing; raise RuntimeError naming why not."""
    if all(Path(binary(b)).is_file() for b in BINARIES):
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RuntimeError(f"SLURM is not installed and cannot be: apt-get install {' '.join(DEBIAN_PACKAGES)} "
                           "needs apt-get and root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *DEBIAN_PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    missing = [b for b in BINARIES if not Path(binary(b)).is_file()]
    if missing:
        raise RuntimeError(f"apt-get install {' '.join(DEBIAN_PACKAGES)} left {missing} missing")


def local_node_names(count: int = 2) -> list[str]:
    """``count`` distinct node names for the test cluster, preferring host names that resolve to
    this machine (as node names do on a real cluster: the sbatch script takes the rendezvous host
    from ``scontrol show hostnames``). ``localhost`` is out: slurm reads it as this host's name.
    Where fewer resolve, ``mpnode<i>`` names fill in; they do not resolve, and the sbatch script
    then falls back to the node's ``NodeAddr`` (127.0.0.1)."""
    local = {"127.0.0.1", "::1"}
    candidates = [socket.gethostname()]
    hosts = Path("/etc/hosts")
    if hosts.is_file():
        for line in hosts.read_text().splitlines():
            fields = line.split("#")[0].split()
            if len(fields) >= 2 and fields[0] in local:
                candidates += fields[1:]
    names = []
    for name in candidates:
        if name in names or name == "localhost" or not name.replace("-", "").isalnum():
            continue
        try:
            if socket.gethostbyname(name).startswith("127."):
                names.append(name)
        except OSError:
            continue
    names += [f"mpnode{i}" for i in range(count)]
    return names[:count]


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


SLURM_CONF = """\
ClusterName=mptest
SlurmctldHost={ctl_host}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
# sbatch --wait polls every 2 s (its interval grows 2 -> 8 -> 32 s only while below MinJobAge/2); 0 also keeps
# every job record, so no finished job's exit status is purged before sbatch reads it
MinJobAge=0
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    """munged + slurmctld + one slurmd per node name, all in ``root``; a context manager.

    Each node offers ``cpus_per_node`` CPUs whatever the machine has (``config_overrides``), so
    several small jobs run at once on a 2-core host."""

    def __init__(self, root: Path, node_names: list[str], cpus_per_node: int = 4):
        self.root = Path(root)
        self.node_names = node_names
        self.cpus_per_node = cpus_per_node
        self.procs: list[subprocess.Popen] = []
        # the client programs (sbatch, and scontrol / srun inside the job) are found on PATH
        path = os.environ.get("PATH", "")
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf"),
                    "PATH": path if "/usr/bin" in path.split(":") else f"{path}:/usr/bin"}

    def __enter__(self) -> "SlurmCluster":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        r = self.root
        for sub in ("munge", "state", "log", *(f"spool/{n}" for n in self.node_names)):
            (r / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o755)  # munged wants the socket folder reachable by all
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self._spawn("munged", [binary("munged"), "--foreground", "--force", f"--socket={r}/munge/munge.socket",
                               f"--key-file={key}", f"--log-file={r}/log/munged.log", f"--pid-file={r}/munge/munged.pid",
                               f"--seed-file={r}/munge/munged.seed"])
        self._wait_for(lambda: (r / "munge" / "munge.socket").exists(), "munged socket", "munged.log")
        ctl_port, *node_ports = _free_ports(1 + len(self.node_names))
        nodes = "\n".join(f"NodeName={n} NodeHostname={n} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus_per_node} State=UNKNOWN"
                          for n, p in zip(self.node_names, node_ports))
        (r / "slurm.conf").write_text(SLURM_CONF.format(root=r, ctl_host=self.node_names[0], ctl_port=ctl_port,
                                                        nodes=nodes))
        self._spawn("slurmctld", [binary("slurmctld"), "-D", "-i", "-f", str(r / "slurm.conf")])
        for name in self.node_names:
            self._spawn(f"slurmd {name}", [binary("slurmd"), "-D", "-N", name, "-f", str(r / "slurm.conf")])
        self._wait_for(self._all_idle, "every node idle in sinfo", "slurmctld.log", timeout=60)

    def _spawn(self, what: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{what.replace(' ', '.')}.stdout", "wb")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def _all_idle(self) -> bool:
        proc = subprocess.run([binary("sinfo"), "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return proc.returncode == 0 and all(states.get(n) == "idle" for n in self.node_names)

    def _wait_for(self, ready, what: str, log_name: str, timeout: float = 30) -> None:
        deadline, dead = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.3)
        raise RuntimeError(f"SLURM test cluster: no {what} within {timeout:.0f} s (daemons that exited: {dead}); "
                           f"{self.logs()[-3000:]}")

    def _num_jobs(self) -> int:
        proc = subprocess.run([binary("squeue"), "-h", "-o", "%i"], env=self.env, capture_output=True, text=True, timeout=30)
        return len(proc.stdout.split()) if proc.returncode == 0 else 0

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel this cluster's jobs, then SIGTERM every daemon it started (by pid, slurmd first)
        and SIGKILL what is left after 10 s."""
        if self.procs and self.procs[-1].poll() is None:  # slurmctld and a slurmd still up
            subprocess.run([binary("scancel"), "--full", "--user", str(os.geteuid())], env=self.env, capture_output=True,
                           timeout=30)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self._num_jobs() > 0:
                time.sleep(0.5)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
