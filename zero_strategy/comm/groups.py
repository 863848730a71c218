"""The default process group: made, asked about, and destroyed.

What the engine, the adapters and the recipes need of the group itself (whether one exists,
its backend, its size, its timeout, its rendezvous store) rather than of a collective over it,
which is ``collectives.py``'s. Together they are the package's only callers of
``torch.distributed`` outside the checkpoint format's readers (docs/architecture.md).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def default_store() -> Any:
    """The default group's rendezvous store: agreements and failure reports go through it,
    because it still answers while a group holds operations some rank never matched."""
    return dist.distributed_c10d._get_default_store()


def group_is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_backend() -> str | None:
    """The default group's backend string, None when no group exists."""
    return str(dist.get_backend()) if group_is_initialized() else None


def group_size() -> int:
    """World size of the default group (1 when none exists)."""
    return dist.get_world_size() if group_is_initialized() else 1


def backend_for(backend: str, device_type: str) -> str | None:
    """The backend a group named ``backend`` uses for tensors on ``device_type``, or None when
    it has none. Torch names a group either by one backend ("gloo", "nccl") or by a map
    ("cpu:gloo,cuda:nccl")."""
    if ":" in backend:
        pairs = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
        return pairs.get(device_type)
    if backend == "nccl":
        return backend if device_type == "cuda" else None
    if backend == "gloo":
        return backend if device_type in ("cpu", "cuda") else None
    return backend  # mpi, ucc, vendor backends: their own checks apply


def default_device(backend: str) -> torch.device:
    """Where a model built on the meta device is materialised: the current CUDA device when
    the group names a backend for CUDA tensors ("nccl", "cpu:gloo,cuda:nccl", "cuda:gloo")
    and a GPU exists, else the CPU (plain "gloo" serves both and means CPU training)."""
    names_cuda = backend != "gloo" and backend_for(backend, "cuda") is not None
    if names_cuda and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_single_process_group(device: torch.device) -> None:
    """A group of one, for a script run without a launcher (no rendezvous needed)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def init_restartable_group(backend: str, timeout: float) -> bool:
    """Create the default group of a worker started by torchrun's elastic agent with its
    rendezvous keys under the attempt number; False (nothing done) outside such a launch or
    when a group exists.

    With the static rendezvous (``accelerate launch``'s), the agent's store outlives a failed
    attempt and torch keys the default group by name only, so the workers of a restarted
    attempt read the dead workers' addresses and fail or hang connecting
    (pytorch/pytorch#135712)."""
    env = os.environ
    if (group_is_initialized() or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or "TORCHELASTIC_RESTART_COUNT" not in env):
        return False
    world, wait = int(env["WORLD_SIZE"]), timedelta(seconds=timeout)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False,
                          timeout=wait)
    attempt = dist.PrefixStore(f"zero_strategy/attempt_{env['TORCHELASTIC_RESTART_COUNT']}",
                               store)
    dist.init_process_group(backend, store=attempt, rank=int(env["RANK"]), world_size=world,
                            timeout=wait)
    return True


def world_barrier() -> None:
    """Every process of the default group reaches this point before any goes on (nothing
    without a group)."""
    if group_is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def destroy_default_group() -> None:
    if group_is_initialized():
        dist.destroy_process_group()


def group_timeout(group: dist.ProcessGroup | None) -> float | None:
    """Seconds the group (default: the world) was created with, ``init_process_group``'s or
    ``new_group``'s ``timeout=`` or the backend's default; None where the backend does not
    say (torch keeps it in each backend's options)."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def splits_communicators() -> bool:
    """Whether new groups are made by splitting the world's communicator (a default group
    bound to a device: torch's own test, a private attribute read here only)."""
    default = dist.distributed_c10d._get_default_group()
    return getattr(default, "bound_device_id", None) is not None
