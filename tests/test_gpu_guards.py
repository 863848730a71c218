"""CPU tests for GPU-only failure classes: a tensor on the wrong device in a collective, the
backend named as a per-device map, the current CUDA device. (Copies that a GPU delays are
tested by test_precision_dist.py's delayed-transfer scenarios.)"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from zero_strategy import engine
from zero_strategy.comm.collectives import Communicator, backend_for, default_device
from zero_strategy.optim.sharded import global_norm


class _Work:
    def wait(self, *args: object) -> bool:
        return True


def _comm_on(device: str, world_size: int = 2) -> Communicator:
    """A communicator as a rank of an nccl group on ``device`` sees it, minus the group: the
    collective calls themselves are replaced in the tests that reach them."""
    comm = Communicator.__new__(Communicator)
    comm.group, comm.rank, comm.world_size = None, 0, world_size
    comm.backend, comm.device, comm.timeout_s = "nccl", torch.device(device), None
    comm._wait_timeout, comm._step = None, None
    comm.bytes_sent, comm.calls = Counter(), Counter()
    return comm


def test_a_host_tensor_in_a_device_collective_is_refused() -> None:
    comm = _comm_on("meta")  # stands for cuda: any device that is not the host
    for call in (lambda t: comm.all_reduce(t), lambda t: comm.all_reduce_max(t),
                 lambda t: comm.broadcast(t), lambda t: comm.all_gather(t, t),
                 lambda t: comm.reduce_scatter(t, t)):
        with pytest.raises(ValueError,
                           match=r"collective \w+.*tensor on cpu.*communicates on meta"):
            call(torch.zeros(2))


def test_offloaded_gradient_norm_is_reduced_on_the_communication_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Offloaded gradient shards live on the host; their norm must reach the collective on
    the group's device (a host tensor in an nccl all-reduce fails at N >= 2 on a GPU)."""
    seen: list[torch.device] = []

    def all_reduce(tensor: torch.Tensor, **kwargs: object) -> _Work:
        seen.append(tensor.device)
        return _Work()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    comm = _comm_on("meta")
    host_grads = [torch.full((3,), 2.0), torch.full((5,), -1.0)]
    for norm_type in (2.0, float("inf")):
        norm = global_norm(host_grads, norm_type, comm, sharded=True)
        assert norm.device == comm.device
    assert seen == [comm.device, comm.device]
    # On the host itself the value is the norm of the concatenation.
    comm_cpu = _comm_on("cpu", world_size=1)
    assert float(global_norm(host_grads, 2.0, comm_cpu, sharded=False)) == pytest.approx(
        (3 * 4.0 + 5 * 1.0) ** 0.5)


@pytest.mark.parametrize(("backend", "cpu", "cuda"), [
    ("gloo", "gloo", "gloo"), ("nccl", None, "nccl"),
    ("cpu:gloo,cuda:nccl", "gloo", "nccl"), ("cuda:gloo", None, "gloo"),
])
def test_backend_is_read_per_device(backend: str, cpu: str | None, cuda: str | None) -> None:
    assert backend_for(backend, "cpu") == cpu and backend_for(backend, "cuda") == cuda


@pytest.mark.parametrize(("backend", "expected"), [
    ("gloo", "cpu"), ("nccl", "cuda:0"), ("cpu:gloo,cuda:nccl", "cuda:0"), ("cuda:gloo", "cuda:0"),
])
def test_meta_models_materialise_where_the_backend_trains(
        monkeypatch: pytest.MonkeyPatch, backend: str, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert default_device(backend) == torch.device(expected)


def test_a_device_the_backend_cannot_serve_is_refused() -> None:
    comm = _comm_on("cpu")
    with pytest.raises(ValueError, match="backend 'nccl' cannot communicate cpu tensors"):
        comm.use_device(torch.device("cpu"))
    comm.use_device(torch.device("cuda", 1))  # nccl serves cuda: accepted, nothing allocated
    assert comm.device == torch.device("cuda", 1)


def test_the_models_gpu_becomes_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user who moved the model to cuda:1 without torch.cuda.set_device(1): the engine
    makes cuda:1 current, or nccl's barriers and object collectives would all use cuda:0."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.__setitem__(0, d.index))
    engine._use_cuda_device(torch.device("cuda", 1))
    assert current == [1]
    engine._use_cuda_device(torch.device("cpu"))
    assert current == [1]

