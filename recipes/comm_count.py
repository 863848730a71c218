"""Bytes a rank sends, counted under any strategy: every collective that reaches a
torch.distributed ProcessGroup through Python is counted with the byte model zero_strategy's
engine uses for its own (ring algorithms, per rank: all-reduce 2 (N-1)/N of the tensor,
all-gather and reduce-scatter (N-1)/N of the full buffer, broadcast the tensor), and
point-to-point sends at their size (zero_strategy exchanges host tensors under gloo that way).

The counter wraps the ProcessGroup methods themselves, not ``torch.distributed.all_reduce``
and friends: libraries keep references to those functions (DeepSpeed takes
``all_gather_into_tensor`` when it initialises, zero_strategy at import) and some call the
group's methods directly, but every Python path ends in a method of the group object.
Traffic a library starts from C++ (DDP's reducer without a comm hook) never passes here:
a world that trained with N >= 2 and counted nothing reports "not measured", not zero.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

_ALL_REDUCE, _GATHER, _SCATTER, _ROOTED, _SEND = (
    "all_reduce", "all_gather", "reduce_scatter", "rooted", "send")


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from _tensors(item)


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


# ProcessGroup method -> (kind, index of the argument whose size the byte model reads):
# all-reduce reads its tensors, all-gather its output, reduce-scatter its input.
METHODS: dict[str, tuple[str, int]] = {
    "allreduce": (_ALL_REDUCE, 0), "allreduce_coalesced": (_ALL_REDUCE, 0),
    "allgather": (_GATHER, 0), "_allgather_base": (_GATHER, 0),
    "all_gather_single": (_GATHER, 0), "allgather_coalesced": (_GATHER, 0),
    "all_gather_single_coalesced": (_GATHER, 0), "allgather_into_tensor_coalesced": (_GATHER, 0),
    "reduce_scatter": (_SCATTER, 1), "_reduce_scatter_base": (_SCATTER, 1),
    "reduce_scatter_single": (_SCATTER, 1), "reduce_scatter_single_coalesced": (_SCATTER, 1),
    "reduce_scatter_tensor_coalesced": (_SCATTER, 1),
    "broadcast": (_ROOTED, 0), "reduce": (_ROOTED, 0),
    "all_to_all_single": (_GATHER, 0), "alltoall_base": (_GATHER, 0), "alltoall": (_GATHER, 0),
    "send": (_SEND, 0),
}


class CommCounter:
    """Installed once per process, before the strategy builds anything. ``total()`` is the
    bytes sent so far; ``paused()`` leaves a stretch out (validation, checkpoints), and
    Python-object exchanges (Lightning's control messages) are never counted, as the
    engine's own counter does not count them."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._local = threading.local()
        self.installed = False

    def total(self) -> int:
        return sum(self.bytes.values())

    def _counting(self) -> bool:
        return getattr(self._local, "paused", 0) == 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._local.paused = getattr(self._local, "paused", 0) + 1
        try:
            yield
        finally:
            self._local.paused -= 1

    def count(self, group: Any, method: str, args: tuple) -> None:
        kind, index = METHODS[method]
        if not self._counting() or len(args) <= index:
            return
        n = group.size()
        if n <= 1:
            return
        nbytes = _nbytes(args[index])
        if method in ("all_to_all_single", "alltoall_base", "alltoall"):
            nbytes = nbytes * (n - 1) // n  # what stays on this rank is not sent
        elif kind == _ALL_REDUCE:
            nbytes = 2 * nbytes * (n - 1) // n
        elif kind in (_GATHER, _SCATTER):
            nbytes = nbytes * (n - 1) // n
        self.bytes[kind if kind != _ROOTED else method] += nbytes
        self.calls[method] += 1

    def install(self) -> CommCounter:
        if self.installed:
            return self
        pg = dist.ProcessGroup
        for method in METHODS:
            original = getattr(pg, method, None)
            if original is not None:
                setattr(pg, method, self._wrap(method, original))
        for name in ("all_gather_object", "broadcast_object_list", "gather_object",
                     "scatter_object_list"):
            self._wrap_uncounted(name)
        self.installed = True
        return self

    def _wrap(self, method: str, original: Callable) -> Callable:
        counter = self

        @functools.wraps(original)
        def counted(group: Any, *args: Any, **kwargs: Any) -> Any:
            counter.count(group, method, args)
            return original(group, *args, **kwargs)

        return counted

    def _wrap_uncounted(self, name: str) -> None:
        original = getattr(dist.distributed_c10d, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def uncounted(*args: Any, **kwargs: Any) -> Any:
            with self.paused():
                return original(*args, **kwargs)

        for module in (dist, dist.distributed_c10d):
            setattr(module, name, uncounted)


COUNTER = CommCounter()
"""The process's counter (one ProcessGroup class per process, so one counter)."""
