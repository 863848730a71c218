"""Scenarios for GPU-only failure classes, run on the CPU (gloo) by test_gpu_guards.py with
shims standing in for what a GPU does differently.

- Host syncs: on a GPU, reading a device value on the host (``.item()``, ``.tolist()``) or
  building a device tensor from a Python list (a copy from pageable memory) makes the host
  wait until the GPU has run everything queued. ``WouldBlock`` counts such calls during a
  steady stage-3 step taken down the GPU's code path (the deferred gather-order check): the
  count must not grow with the number of units, or the host could not run ahead of the GPU
  and prefetching could not overlap compute.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Any

import torch
from torch import nn

import zero_strategy as zs
from tests.support.harness import register

_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
          "nonzero")
"""Tensor methods that copy a device value to the host and wait for it."""
_FROM_HOST = ("tensor", "as_tensor")
"""Factories that copy Python values to the device named by ``device=`` (pageable memory)."""


class WouldBlock:
    """Counts, by name, the calls in its scope that would block the host on a GPU. The
    methods are patched on the classes (a TorchFunctionMode does not reach the code autograd
    runs in backward: hooks and end-of-backward callbacks)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    def _count(self, owner: Any, name: str, only_with_device: bool) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if not only_with_device or kwargs.get("device") is not None:
                self.calls[name] += 1
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> WouldBlock:
        for name in _READS:
            self._count(torch.Tensor, name, only_with_device=False)
        for name in _FROM_HOST:
            self._count(torch, name, only_with_device=True)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _stack(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(24, 24), nn.GELU()) for _ in range(layers)),
                         nn.Linear(24, 3))


def steady_step_syncs(layers: int) -> dict[str, Any]:
    """What would block the host during the third step of a stage-3 engine (after the first
    steps built everything lazily made), with the gather-order check deferred as on a GPU."""
    model = _stack(layers)
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           zs.ZeroConfig(stage=3, unit_numel=500, param_persistence_threshold=0))
    engine.runtime.gather_check.deferred = True  # the GPU's path: tags read once per backward
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    data = [(torch.randn(4, 24, generator=generator), torch.randint(0, 3, (4,),
                                                                     generator=generator))
            for _ in range(3)]
    counter = WouldBlock()
    for step, (x, y) in enumerate(data):
        mode = counter if step == 2 else contextlib.nullcontext()
        with mode:
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
    units = len(engine.units)
    engine.close()
    return {"units": units, "calls": dict(counter.calls)}


for _layers in (2, 6):
    register(f"syncs_{_layers}_layers", steady_step_syncs, layers=_layers)


def timeout_on_a_device_map_backend() -> dict[str, Any]:
    """A group named by a map ("cpu:gloo"), as "cpu:gloo,cuda:nccl" names one: a CPU model
    communicates through gloo, so ``ZeroConfig.timeout`` bounds its waits. Rank 1 never joins
    rank 0's collective; rank 0 must raise ``CollectiveTimeout`` after the 2 s asked, not
    wait for the group's own 60 s."""
    from datetime import timedelta

    from zero_strategy.comm.collectives import CollectiveTimeout, Communicator

    group = torch.distributed.new_group(backend="cpu:gloo", timeout=timedelta(seconds=60))
    comm = Communicator(group, timeout=2.0)
    result: dict[str, Any] = {"backend": comm.backend}
    if comm.rank == 0:
        started = time.monotonic()
        try:
            comm.all_reduce_max_to_host(torch.ones(1))
            result["raised"] = None
        except CollectiveTimeout as e:
            result["raised"] = str(e)
        result["seconds"] = time.monotonic() - started
    torch.distributed.barrier()  # rank 1 keeps its end of the group open meanwhile
    return result


register("timeout_on_a_device_map_backend", timeout_on_a_device_map_backend)
