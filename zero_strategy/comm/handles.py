"""What a started collective gives back: a handle to wait on or poll.

``Communicator`` (``collectives.py``) makes them; the runtime and the stores hold them between
the call that started a collective and the point that needs its result.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, Protocol

from .groups import group_is_initialized

_ORPHANED_WORKS: list[Any] = []
"""Sends and receives never waited for whose group was destroyed (``Exchange.__del__``):
held to the end of the process, never freed."""
try:  # never freed, not even at interpreter exit
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_ORPHANED_WORKS))
except AttributeError:
    pass


class Waiter(Protocol):
    """What a handle waits through: the communicator that started its collective, which
    bounds the wait and names the collective, the step and the peer in an error."""

    def wait(self, work: Any, op: str, host: bool = False, peer: int | None = None) -> None:
        """Block until ``work`` completes, within the timeout; a failure raises
        ``CollectiveError`` naming ``op`` (and ``peer``, one side of a direct exchange)."""


class Handle(Protocol):
    def wait(self, host: bool = False) -> object:
        """Complete for the device's next work; ``host=True``: also for the host, which is
        about to read the result (then bounded by the timeout on every backend)."""

    def ready(self) -> bool:
        """Whether ``wait`` would return at once (never blocks; a backend that cannot tell
        answers False until waited for)."""


class Done:
    """The handle of a collective that ran synchronously (one rank, nothing to wait for)."""

    def wait(self, host: bool = False) -> bool:
        return True

    def ready(self) -> bool:
        return True


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:  # failed: waiting raises the error, naming the collective
        return True


class Pending:
    """An asynchronous collective; ``wait()`` is bounded by the communicator's timeout and
    turns a failure into an error naming the collective."""

    def __init__(self, comm: Waiter, work: Any, op: str) -> None:
        self.comm, self.work, self.op = comm, work, op

    def wait(self, host: bool = False) -> bool:
        self.comm.wait(self.work, self.op, host=host)
        return True

    def ready(self) -> bool:
        return _completed(self.work)


class Exchange:
    """Point-to-point sends and receives that together make one collective, each with the
    rank (in the group) it goes to or comes from; ``wait()`` waits for all of them (bounded
    like any collective), then runs ``finish`` once."""

    def __init__(self, comm: Waiter, works: list[tuple[Any, int]], op: str,
                 finish: Callable[[], None] | None = None) -> None:
        self.comm, self.works, self.op, self.finish = comm, works, op, finish

    def wait(self, host: bool = False) -> bool:
        works, self.works = self.works, []
        for work, peer in works:
            self.comm.wait(work, self.op, host=host, peer=peer)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True

    def ready(self) -> bool:
        return all(_completed(w) for w, _ in self.works)

    def __del__(self) -> None:
        # Never waited for, and the group destroyed since (a script that ends on step() and
        # destroy_process_group(): the post-step gathers are still pending): destroying a
        # send or receive of a destroyed gloo group aborts the process at exit (seen 2 runs
        # in 6 of bench/routed_memory.py). Kept instead, never freed: the process is ending.
        if self.works and not group_is_initialized():
            _ORPHANED_WORKS.extend(self.works)
            self.works = []


class Then:
    """``handle``, then ``after()`` on the host once it is waited for."""

    def __init__(self, handle: Handle, after: Callable[[], None]) -> None:
        self.handle, self.after = handle, after

    def wait(self, host: bool = False) -> bool:
        self.handle.wait(host=host)
        if self.after is not None:
            after, self.after = self.after, None
            after()
        return True

    def ready(self) -> bool:
        return self.handle.ready()


class Chain:
    """A collective made of two, the second launched once the first has completed: when
    the first is found done (``ready``, polled while other work goes on) or at ``wait``."""

    def __init__(self, first: Handle, then: Callable[[], Handle]) -> None:
        self.first: Handle | None = first
        self.then: Callable[[], Handle] | None = then
        self.second: Handle | None = None

    def _advance(self, host: bool) -> Handle:
        if self.second is None:
            assert self.first is not None and self.then is not None
            self.first.wait(host=host)
            self.second, self.first, self.then = self.then(), None, None
        return self.second

    def wait(self, host: bool = False) -> bool:
        return bool(self._advance(host).wait(host=host))

    def ready(self) -> bool:
        if self.second is None and not (self.first is not None and self.first.ready()):
            return False
        return self._advance(False).ready()
