"""A real SLURM cluster on this host for the tests: munged, slurmctld and two slurmd (nodes
named after the host and ``zs2``, each claiming the host's CPUs, so a job can span two
"nodes"; the first name resolves, as a real node's does, for launchers that take the address
from the node list) started from a ``slurm.conf`` written into a temporary directory, on free
ports, and stopped afterwards.

It installs nothing: where Debian's ``slurm-wlm`` and ``munge`` are not installed (``.ci/run``
installs them when it runs as root), or where the daemons cannot run (slurmd runs as root),
the tests using it are skipped with the reason. Commands reach this cluster through
``SLURM_CONF`` in ``Cluster.env``; nothing of the machine's own SLURM configuration is read.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.nodes import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scancel")


NODES = (socket.gethostname(), "zs2")


@dataclass
class Cluster:
    directory: Path
    env: dict[str, str]
    """The environment a command submitted to this cluster needs (``SLURM_CONF``)."""

    def run(self, *args: str, timeout: float = 60.0) -> str:
        done = subprocess.run(list(args), env={**os.environ, **self.env}, capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}\n{self.logs()}")
        return done.stdout

    def logs(self, chars: int = 2000) -> str:
        out = []
        for name in ("slurmctld.log", *(f"slurmd-{n}.log" for n in NODES), "munged.log"):
            path = self.directory / "log" / name
            if path.exists():
                out.append(f"--- {name}\n{path.read_text()[-chars:]}")
        return "\n".join(out)


def why_not() -> str | None:
    """Why this machine cannot run the cluster (None: it can)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} not found; Debian: apt-get "
                "install slurm-wlm munge)")
    if os.geteuid() != 0:
        return "slurmd needs root to start jobs"
    return None


def _config(d: Path, host: str, cpus: int, ctld: int, slurmd: int) -> str:
    plugins = next((p for p in ("/usr/lib/x86_64-linux-gnu/slurm-wlm",
                                "/usr/lib/aarch64-linux-gnu/slurm-wlm", "/usr/lib64/slurm")
                    if Path(p).is_dir()), None)
    lines = [
        "ClusterName=zstest", f"SlurmctldHost={host}", f"SlurmctldPort={ctld}",
        "AuthType=auth/munge", f"AuthInfo=socket={d}/munge.sock",
        "CredType=cred/munge", "SlurmUser=root", "SlurmdUser=root",
        # Several slurmd on one host: each node's files by its name (%n).
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool-%n",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
        # No cgroups in a container: processes are tracked by parentage, tasks not bound.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "ReturnToService=2", "SchedulerType=sched/backfill", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        # A requeued job may start again at once (the default holds it for 60 s).
        "MinJobAge=2", "KillWait=5",
        *(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={slurmd + i} "
          f"CPUs={cpus} RealMemory=4000 State=UNKNOWN" for i, name in enumerate(NODES)),
        # Jobs share the node's cores: the tests' jobs are small and run side by side.
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=FORCE:8",
    ]
    if plugins is not None:
        lines.append(f"PluginDir={plugins}")
    return "\n".join(lines) + "\n"


def start(directory: Path, timeout: float = 60.0) -> Cluster:
    """Start the daemons; the returned cluster answers ``sinfo`` with its nodes idle."""
    d = directory
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    host, cpus = socket.gethostname(), os.cpu_count() or 1
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    subprocess.run(["munged", "--force", f"--key-file={d}/munge.key",
                    f"--socket={d}/munge.sock", f"--pid-file={d}/munged.pid",
                    f"--log-file={d}/log/munged.log", f"--seed-file={d}/munge.seed"],
                   check=True, capture_output=True)
    conf = d / "slurm.conf"
    ctld = free_port(1 + len(NODES))
    conf.write_text(_config(d, host, cpus, ctld, ctld + 1))
    cluster = Cluster(d, {"SLURM_CONF": str(conf)})
    try:
        cluster.run("slurmctld", "-f", str(conf))
        for name in NODES:
            cluster.run("slurmd", "-f", str(conf), "-N", name)
        deadline = time.monotonic() + timeout
        while cluster.run("sinfo", "-h", "-N", "-o", "%T").split() != ["idle"] * len(NODES):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test cluster's nodes never became idle\n{cluster.logs()}")
            time.sleep(0.5)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def cancel_all(cluster: Cluster, timeout: float = 60.0) -> None:
    """Cancel every job and wait until the queue is empty."""
    env = {**os.environ, **cluster.env}
    subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True,
                   timeout=30)
    deadline = time.monotonic() + timeout
    while cluster.run("squeue", "-h", "-o", "%i").strip():
        if time.monotonic() > deadline:
            raise RuntimeError("jobs cancelled a minute ago are still in the queue:\n"
                               + cluster.run("squeue", "-a") + cluster.logs())
        time.sleep(0.5)


def stop(cluster: Cluster) -> None:
    """Cancel every job, then stop slurmd, slurmctld and munged (SIGTERM, then SIGKILL)."""
    subprocess.run(["scancel", "--full", "--user=root"], env={**os.environ, **cluster.env},
                   capture_output=True, timeout=30)
    for name in (*(f"slurmd-{n}" for n in NODES), "slurmctld", "munged"):
        pid_file = cluster.directory / f"{name}.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        _terminate(pid)


def _terminate(pid: int, grace: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
