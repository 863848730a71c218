"""CPU tests for GPU-only failure classes: a tensor on the wrong device in a collective, the
backend named as a per-device map, the current CUDA device. (Copies that a GPU delays are
tested by test_precision_dist.py's delayed-transfer scenarios.)"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import zero_strategy as zs
from tests.support.harness import check, run_world
from zero_strategy.comm.collectives import Communicator
from zero_strategy.comm.groups import backend_for, default_device
from zero_strategy.core.devices import canonical_device
from zero_strategy.engine import setup as engine
from zero_strategy.optim.sharded import global_norm


@pytest.fixture(scope="module")
def world() -> dict:
    return run_world("tests/worlds/scenarios_gpu_guards.py", 2)


def test_a_steady_step_blocks_the_host_a_fixed_number_of_times(world: dict) -> None:
    """Down the GPU's path, a stage-3 step reads three things on the host, whatever the
    number of units, one ``tolist`` each: the gather-order tags of the whole backward and
    which parameters any rank used (at the end of backward), and whether any rank's
    gradients are non-finite (in ``step``, which must know whether to skip). Before, each
    gather's tag was built from a Python list: one blocking copy per gather."""
    small, large = check(world["syncs_2_layers"]), check(world["syncs_6_layers"])
    assert small[0]["units"] < large[0]["units"], (small, large)
    for rank in range(2):
        assert small[rank]["calls"] == large[rank]["calls"] == {"tolist": 3}, (small, large)


class _Work:
    def wait(self, *args: object) -> bool:
        return True


def _comm_on(device: str, world_size: int = 2) -> Communicator:
    """A communicator as a rank of an nccl group on ``device`` sees it, minus the group: the
    collective calls themselves are replaced in the tests that reach them."""
    comm = Communicator.__new__(Communicator)
    comm.group, comm.rank, comm.world_size = None, 0, world_size
    comm.backend, comm.device, comm.timeout_s = "nccl", torch.device(device), None
    comm._wait_timeout, comm._host_timeout, comm._step = None, None, None
    comm._gloo = False  # nccl: no worker-thread collective is kept for exit (_KEPT_WORKS)
    comm.bytes_sent, comm.calls = Counter(), Counter()
    return comm


def test_a_cpu_model_on_a_device_map_backend_times_out_as_asked(world: dict) -> None:
    r = check(world["timeout_on_a_device_map_backend"])[0]
    assert r["backend"] == "cpu:gloo", r
    assert r["raised"] and "did not complete within 2 s (ZeroConfig.timeout)" in r["raised"], r
    assert r["seconds"] < 30, r  # the group's own timeout is 60 s


class _Recording:
    def __init__(self) -> None:
        self.limits: list[object] = []

    def wait(self, *limit: object) -> bool:
        self.limits.append(limit[0] if limit else None)
        return True


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_on_nccl_only_the_waits_the_host_reads_after_are_bounded(
        monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """nccl's ``wait(timeout)`` blocks the host until the GPU is done: bounded waits only
    where the host reads the result next (then a lost peer raises ``CollectiveTimeout``
    instead of nccl's watchdog ending the process); asynchronous reductions stay unbounded
    so the host runs ahead."""
    work = _Recording()
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: work)
    comm = _comm_on("meta")  # a device nccl serves
    comm.backend, comm.timeout_s = backend, 5.0
    comm._host_timeout = timedelta(seconds=5)
    comm.use_device(torch.device("cuda", 0))
    comm._check = lambda *a: None  # CPU tensors stand in for the GPU's
    comm.all_reduce(torch.ones(1), async_op=True).wait()
    assert work.limits == [None]
    comm.all_reduce_max_to_host(torch.ones(1))
    assert work.limits == [None, timedelta(seconds=5)]


def test_a_subgroup_splits_its_own_communicator_where_nccl_splits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hybrid sharding inside a subgroup (ranks 4-7 of a larger world) while nccl makes groups
    by splitting the world's communicator: ``new_group`` would need the other ranks of the
    world too, so the shard and replica groups are split from the subgroup itself, each
    partition whole and in order."""
    from zero_strategy.comm import groups

    splits: list[tuple[object, list[list[int]]]] = []
    monkeypatch.setattr(groups, "splits_communicators", lambda: True)
    monkeypatch.setattr(dist, "split_group", lambda parent, parts, timeout=None:
                        splits.append((parent, parts)) or f"group {len(splits)}")
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: pytest.fail("new_group called"))
    comm = _comm_on("cuda:0", world_size=4)
    comm.group, comm._peers, comm.rank = "the subgroup", [4, 5, 6, 7], 1
    assert comm._subgroup([[0, 1], [2, 3]]) == "group 1"
    assert comm._subgroup([[0, 2], [1, 3]]) == "group 2"
    assert splits == [("the subgroup", [[0, 1], [2, 3]]), ("the subgroup", [[0, 2], [1, 3]])]


@pytest.mark.parametrize(("setting", "deferred"), [(True, True), ("blocking", False)])
def test_a_gpu_checks_the_gather_order_where_asked(setting: bool | str, deferred: bool) -> None:
    """On a GPU the default check is read at the end of backward, after mismatched gathers
    ran (nccl may end the job first); ``check_gather_order="blocking"`` checks before each
    gather there too, so the error comes before any wrong exchange."""
    from zero_strategy.core.plan import make_plan
    from zero_strategy.core.runtime import Runtime

    plan = make_plan(zs.ZeroConfig(stage=3, check_gather_order=setting), world_size=2)
    comm = _comm_on("cuda:0")
    runtime = Runtime([], comm, torch.nn.Linear(1, 1), plan.prefetch, plan.check_gather_order,
                      world=comm, blocking_order_check=plan.blocking_order_check)
    assert runtime.gather_check.check and runtime.gather_check.deferred is deferred


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


@pytest.mark.parametrize(("given", "expected"), [
    ("cuda", "cuda:1"), (torch.device("cuda"), "cuda:1"), ("cuda:0", "cuda:0"),
    ("cpu", "cpu"), ("cpu:0", "cpu"), ("meta", "meta"),
])
def test_devices_are_named_as_their_tensors_report_them(
        monkeypatch: pytest.MonkeyPatch, given: str | torch.device, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert canonical_device(given) == torch.device(expected)
    assert str(canonical_device(given)) == expected


def test_an_engine_given_cuda_without_an_index_uses_the_current_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``device="cuda"`` for a model on the meta device: the engine's device must compare
    equal to the device of the tensors it creates there (cuda:<current>), or no gradient
    is ever adopted and sharded init's records never match."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with torch.device("meta"):
        model = torch.nn.Linear(3, 3)
    assert engine._single_device(model, "cuda", "nccl") == torch.device("cuda", 1)
    assert engine._single_device(model, torch.device("cuda"), "nccl") == torch.device("cuda", 1)


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

