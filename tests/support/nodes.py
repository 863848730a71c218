"""Several "nodes" on this machine: one launcher process per node (two torch.distributed.run
agents, two ``accelerate launch``, two Hydra processes), started together, each in its own
session, and waited for with a deadline.

A node that fails makes the others fail or wait: its peers' collectives break, or an agent
waits at the rendezvous for a node that never comes (torch's join timeout is 10 minutes). So
once one node has failed the others get ``GRACE_S`` to finish on their own, then every
node's whole process group is killed, as at the deadline; the outcome says which.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 30.0

sys.path.insert(0, str(ROOT / "bench"))
from cluster import wait_for  # noqa: E402  (bench/cluster.py: the cluster in a box's)


def free_port(span: int = 1) -> int:
    """A port P with P .. P+span-1 free on 127.0.0.1 (the recipes use P and P+1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span - 1 <= 65535 and all(_free(port + i) for i in range(1, span)):
            return port
    raise RuntimeError(f"no {span} consecutive free ports found")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "TORCHELASTIC_")) and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
               "GROUP_RANK", "ZERO_STRATEGY_CONFIG")}
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    env.update(extra or {})
    return env


@dataclass
class Nodes:
    returncodes: list[int | None]
    """Each node's exit status; None: killed (still running after a peer failed or at the
    deadline)."""
    logs: list[str]
    timed_out: bool

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)

    def tail(self, chars: int = 4000) -> str:
        return "\n".join(f"--- node {i} (exit {code})\n{log[-chars:]}" for i, (code, log)
                         in enumerate(zip(self.returncodes, self.logs)))


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def run_nodes(commands: list[list[str]], logs: Path, env: dict[str, str] | None = None,
              timeout: float = 300.0, first_serves: int | None = None,
              envs: list[dict[str, str]] | None = None) -> Nodes:
    """Run one command per node at once and wait for all of them. ``first_serves``: a port
    the first node must be listening on before the others start (``accelerate launch``
    refuses to start machine 0 when its port is taken, here by another node's agent).
    ``envs``: per node, on top of ``env``."""
    logs.mkdir(parents=True, exist_ok=True)
    files = [open(logs / f"node{i}.log", "w") for i in range(len(commands))]
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout
    for i, (command, log) in enumerate(zip(commands, files)):
        if i == 1 and first_serves is not None:
            _wait_listening(first_serves, procs[0], deadline)
        node_env = {**(env or {}), **(envs[i] if envs else {})}
        procs.append(subprocess.Popen(command, cwd=ROOT, env=environment(node_env), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    wait_for(procs, deadline, GRACE_S)
    timed_out = time.monotonic() > deadline
    codes: list[int | None] = []
    for p in procs:
        codes.append(p.poll())
        if codes[-1] is None:
            _kill(p)
    for f in files:
        f.close()
    return Nodes(codes, [(logs / f"node{i}.log").read_text() for i in range(len(procs))],
                 timed_out)


def _wait_listening(port: int, proc: subprocess.Popen, deadline: float) -> None:
    while proc.poll() is None and time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)


def _kill(proc: subprocess.Popen) -> None:
    """The node's launcher and everything it started: its session (agent and workers), and
    the sessions of its descendants (the recipes fork their agent into a session of its own,
    recipes/agent.py), found before anything is killed, while they are still its children."""
    groups = {proc.pid}
    for pid in _descendants(proc.pid):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
