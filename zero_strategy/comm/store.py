"""The rendezvous store beside the collectives: failure reports a peer's error can quote,
and agreements that must not queue behind a group's unmatched operations.

Both run while something has already gone wrong, so neither may make it worse: a store
across a cut link never answers (torch's client waits on its socket past its own timeout;
even cancelling a ``wait`` is a blocking round trip), and one whose host died answers with
``Broken pipe``. Every call is therefore made on a helper thread and waited for a bounded
time, and a failure report never raises: the error being reported is the one to see.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

REPORT_BOUND_S = 5.0
"""The longest a failure report, or the lookup of other ranks' reports while an error is
being raised, waits for the store."""
REPORT_WAIT_S = 3.0
"""How long a rank whose collective timed out waits for a peer's failure report to appear
before raising (the peer's report is often a moment behind the timeout, most on a loaded
host); only on that path, and only while no report is there."""

_T = TypeVar("_T")


class StoreSilent(TimeoutError):
    """The rendezvous store did not answer within the bound (across a cut link it never
    will)."""


_SILENT: list[Any] = []
"""Stores that once did not answer: a call stuck on one holds its client's lock, so every
later call would queue behind it; they are not called again (held here, so that no other
store takes the identity of one dropped)."""


def bounded_call(store: Any, call: Callable[[Any], _T], seconds: float) -> _T:
    """``call(store)``, waited for at most ``seconds`` on a daemon thread, which is left
    behind if it does not return (the process is on its way to raising by then). Raises
    ``StoreSilent``, or what the call raised."""
    if any(store is silent for silent in _SILENT):
        raise StoreSilent("the rendezvous store did not answer before")
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call(store))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name="zero_strategy-store", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _SILENT.append(store)
        raise StoreSilent(f"the rendezvous store did not answer within {seconds:g} s")
    if error:
        raise error[0]
    return result[0]


class Ledger:
    """One communicator's keys in the store: its ranks' failure reports and agreements.
    ``store`` gives the store when called (the default group's, looked up late: a group
    destroyed since has none)."""

    def __init__(self, store: Callable[[], Any], prefix: str, rank: int, world_size: int
                 ) -> None:
        self._store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self._agreements = 0
        self._left = False
        self.lost: str | None = None
        """Why the last report could not be left or cleared (None: it was)."""

    def _call(self, call: Callable[[Any], _T], seconds: float | None = None) -> _T:
        return bounded_call(self._store(), call, REPORT_BOUND_S if seconds is None else seconds)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/failed/{rank}"

    def report(self, message: str) -> bool:
        """Leave this rank's error for its peers. Never raises: it runs while that error is
        on its way up, and a store that cannot be reached must not replace it with its own.
        False when the report could not be left (``lost`` says why)."""
        if self.world_size == 1:
            return True
        key = self._key(self.rank)
        try:
            self._call(lambda store: store.set(key, message[:500]))
        except Exception as e:  # noqa: BLE001 - see above
            self.lost = f"{type(e).__name__}: {e}"
            return False
        self._left = True
        return True

    def clear(self) -> None:
        """Remove this rank's report, if one was left; never raises (a store gone since has
        nothing a peer could read)."""
        if not self._left:
            return
        self._left = False
        key = self._key(self.rank)
        try:
            self._call(lambda store: store.delete_key(key))
        except Exception as e:  # noqa: BLE001 - see above
            self.lost = f"{type(e).__name__}: {e}"

    def reported(self, wait_s: float = 0.0) -> str:
        """What the other ranks reported, as the tail of an error message; never raises.
        ``wait_s``: how long to wait for a first report when none is there yet (a rank that
        timed out waiting for a peer usually did so because that peer failed, and its report
        may be a moment behind: the error then names the cause, not only the symptom)."""
        if self.world_size == 1:
            return ""
        keys = {r: self._key(r) for r in range(self.world_size) if r != self.rank}

        def read(store: Any) -> list[str]:
            deadline = time.monotonic() + wait_s
            while True:
                found = [f"rank {r} failed: {store.get(k).decode(errors='replace')}"
                         for r, k in keys.items() if store.check([k])]
                if found or time.monotonic() >= deadline:
                    return found
                time.sleep(0.1)

        try:
            found = self._call(read, REPORT_BOUND_S + wait_s)
        except StoreSilent as e:
            return f"; {e}, so no other rank's report could be read"
        except Exception:  # noqa: BLE001 - the store itself is gone: nothing more to say
            return ""
        return ("; " + "; ".join(found)) if found else ""

    def agree(self, value: int, seconds: float) -> list[int]:
        """Every rank's ``value``, by rank; waits ``seconds`` for the others. Raises
        ``StoreSilent`` or the store's error."""
        if self.world_size == 1:
            return [value]
        self._agreements += 1
        prefix = f"{self.prefix}/agree{self._agreements}"
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]

        def exchange(store: Any) -> list[int]:
            store.set(f"{prefix}/{self.rank}", str(value))
            store.wait(keys, timedelta(seconds=seconds))
            return [int(store.get(k)) for k in keys]

        return self._call(exchange, seconds + REPORT_BOUND_S)  # the store's wait, then ours
