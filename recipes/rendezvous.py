"""How a recipe job's nodes find each other: ``trainer.num_nodes`` and ``trainer.rdzv_endpoint``
checked in the Hydra process, and the torch.distributed.run options they become.

One node (``trainer.num_nodes=1``, the default) rendezvouses on its own (``--standalone``).
Inside a SLURM step with one task on each of several nodes (a sweep's job submitted with
``hydra/launcher=submitit_slurm hydra.launcher.nodes=N``), the nodes, the endpoint and the id
come from the allocation (``slurm_nodes``): nothing to set.
Several nodes run the same command, each its own Hydra process starting ``trainer.devices``
workers under its own agent, with ``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT
--rdzv-id ID``: the agent on HOST serves the rendezvous store, the others connect to it, and
torch assigns node and global ranks. Nothing here needs torch (the checks run before any
worker starts).

Per job, in a sweep: every node's Hydra process runs the sweep's jobs in the same order, and
job k of each node must meet job k of the others. The id is derived from the job (its name and
its number in the sweep), so it is the same on every node without anyone choosing it. The
port alternates between PORT (even job numbers) and PORT+1 (odd ones): a node that finished
job k starts job k+1's agent at once, while the agent that served job k's store may still be
exiting on HOST; on the same port, the new agent could connect to that dying store as a client
and fail when it closes. Job k+2 can reuse PORT only after job k+1's rendezvous completed on
every node, which needs every node's job-k agent to have exited, so no stale store is left.
(Not seen failing on one port: 3 four-job sweeps on 2 "nodes" of this machine, 9 hand-overs,
all passed; the node starting the next job has far more to do than the exiting agent. The
second port makes it impossible rather than unlikely.)
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

LAUNCHER_ID = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
"""This Hydra process, as the workers it starts record it (``$ZS_LAUNCHER_ID``): the job's
metrics name the process that started rank 0, which alone writes the sweep report."""


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int
    endpoint: str
    run_id: str

    def torchrun_args(self) -> list[str]:
        return ["--nnodes", str(self.nnodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id]


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as (host, port); ValueError naming the key when
    it is not one, or when PORT+1 (the odd jobs' port) is not a port."""
    host, sep, port = str(endpoint).rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65534:
        raise ValueError(
            f"trainer.rdzv_endpoint={endpoint!r} is not HOST:PORT with PORT in 1..65534 "
            "(the node serving the rendezvous and a port every node can reach; a sweep's "
            "jobs use PORT and PORT+1 in turn)")
    return host, int(port)


SLURM_PORTS = (20000, 10000)
"""A job's rendezvous port inside a SLURM allocation: 20000 + its job id modulo 10000, the
same on every node without anyone choosing it (and again when the job is requeued)."""


def slurm_nodes() -> tuple[int, str, str] | None:
    """Inside a SLURM step that runs one task on each of several nodes (what
    hydra-submitit-launcher starts for ``hydra.launcher.nodes=N tasks_per_node=1``):
    (the number of nodes, the address of the node the step was launched from, which runs
    its first task, the job id). None elsewhere."""
    env = os.environ
    try:
        nodes, tasks = int(env["SLURM_STEP_NUM_NODES"]), int(env["SLURM_STEP_NUM_TASKS"])
    except (KeyError, ValueError):
        return None
    host, job = env.get("SLURM_LAUNCH_NODE_IPADDR"), env.get("SLURM_JOB_ID")
    if nodes < 2 or tasks != nodes or not host or not job:
        return None
    return nodes, host, job


def check_nodes(trainer: Any) -> None:
    """The multi-node keys, refused with the key named before any worker starts."""
    nodes, endpoint = int(trainer.num_nodes), trainer.rdzv_endpoint
    if nodes < 1:
        raise ValueError(f"trainer.num_nodes={nodes}: must be 1 or more (machines, each "
                         "running trainer.devices processes)")
    allocation = slurm_nodes()
    if allocation is not None and endpoint is None:
        if nodes not in (1, allocation[0]):
            raise ValueError(
                f"trainer.num_nodes={nodes}, but this SLURM step runs one task on each of "
                f"{allocation[0]} nodes: set trainer.num_nodes={allocation[0]}, or leave it 1 "
                "to take the allocation's nodes")
        return
    if nodes == 1:
        if endpoint is not None:
            raise ValueError(
                f"trainer.rdzv_endpoint={endpoint!r} with trainer.num_nodes=1: a one-node job "
                "rendezvouses on its own (--standalone) and would not use it; set "
                "trainer.num_nodes to the number of machines, or remove the endpoint")
        return
    if endpoint is None:
        raise ValueError(
            f"trainer.num_nodes={nodes} needs trainer.rdzv_endpoint=HOST:PORT: the address "
            "of one of the nodes, the same on every node, where torch.distributed.run's c10d "
            "rendezvous store is served (jobs of a sweep use PORT and PORT+1 in turn)")
    split_endpoint(endpoint)


def job_rendezvous(trainer: Any, name: str, job_num: int | None) -> Rendezvous | None:
    """The job's rendezvous across nodes, None for a one-node job. ``job_num``: the job's
    number in a sweep (Hydra's ``hydra.job.num``), None for a single run."""
    check_nodes(trainer)
    allocation = slurm_nodes()
    if allocation is not None and trainer.rdzv_endpoint is None:
        nnodes, host, job = allocation
        base, span = SLURM_PORTS
        return Rendezvous(nnodes, f"{host}:{base + int(job) % span}", f"slurm-{job}")
    if int(trainer.num_nodes) == 1:
        return None
    host, port = split_endpoint(trainer.rdzv_endpoint)
    number = 0 if job_num is None else job_num
    run_id = f"{name}-job{number}" if job_num is not None else f"{name}-run"
    return Rendezvous(int(trainer.num_nodes), f"{host}:{port + number % 2}", run_id)
