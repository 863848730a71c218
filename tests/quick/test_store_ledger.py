"""The rendezvous store's part in failures (``zero_strategy.comm.store``): a failure report
that cannot reach the store never raises (it runs while another error is on its way up and
must not replace it, issue 55), a store that does not answer is waited for a bounded time,
and agreements through an unreachable store raise a timeout instead of hanging. No process
group: the stores here stand in for torch's ``TCPStore`` (the real one across a cut link:
tests/integration/test_link_faults.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from zero_strategy.comm import store as store_module
from zero_strategy.comm.store import Ledger, StoreSilent


class BrokenPipe:
    """A store whose host died: every call fails as torch's client does then."""

    def __getattr__(self, name: str) -> Any:
        def fail(*_: Any, **__: Any) -> Any:
            raise dist.DistNetworkError("Broken pipe")
        return fail


class Silent:
    """A store across a cut link: every call waits until released (for ever, in life)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        def hang(*_: Any, **__: Any) -> Any:
            self.release.wait()
            raise dist.DistNetworkError("connection reset")
        return hang


@pytest.fixture
def short_bound(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(store_module, "REPORT_BOUND_S", 0.2)
    return 0.2


def test_a_report_to_a_dead_store_is_lost_not_raised() -> None:
    ledger = Ledger(BrokenPipe, "p", rank=0, world_size=2)
    assert ledger.report("ValueError in forward at step 3: boom") is False
    assert ledger.lost is not None and "DistNetworkError: Broken pipe" in ledger.lost
    ledger.clear()  # nothing was left: nothing to clear, nothing raised
    assert ledger.reported() == ""


def test_a_report_is_left_read_and_cleared_through_a_live_store() -> None:
    shared = dist.HashStore()
    mine, peer = (Ledger(lambda: shared, "p", rank=r, world_size=2) for r in (0, 1))
    assert mine.report("ValueError in forward at step 3: boom")
    assert peer.reported() == "; rank 0 failed: ValueError in forward at step 3: boom"
    mine.clear()
    assert peer.reported() == ""


def test_a_report_a_moment_late_is_waited_for_only_when_asked() -> None:
    """After a timeout the rank waits (``wait_s``) for the peer whose failure caused it: a
    report left 0.3 s later is in the message; without waiting it is not; with no report at
    all the wait ends at its bound."""
    shared = dist.HashStore()
    mine, peer = (Ledger(lambda: shared, "p", rank=r, world_size=2) for r in (0, 1))
    late = threading.Timer(0.3, lambda: mine.report("InjectedFault in backward"))
    late.start()
    try:
        assert peer.reported() == ""
        assert peer.reported(wait_s=5.0) == "; rank 0 failed: InjectedFault in backward"
    finally:
        late.join()
    mine.clear()
    start = time.monotonic()
    assert peer.reported(wait_s=0.5) == ""
    assert 0.5 <= time.monotonic() - start < 3.0


def test_a_silent_store_is_waited_for_a_bounded_time(short_bound: float) -> None:
    silent = Silent()
    ledger = Ledger(lambda: silent, "p", rank=0, world_size=2)
    try:
        start = time.monotonic()
        assert ledger.report("boom") is False
        assert "did not answer within" in (ledger.lost or "")
        assert "did not answer" in ledger.reported()
        # the stuck call holds the client: later ones are not made at all
        assert time.monotonic() - start < 10 * short_bound
    finally:
        silent.release.set()


def test_an_agreement_through_a_silent_store_times_out(short_bound: float) -> None:
    silent = Silent()
    try:
        with pytest.raises(StoreSilent, match="did not answer within"):
            Ledger(lambda: silent, "p", rank=0, world_size=2).agree(1, seconds=0.1)
    finally:
        silent.release.set()


def test_an_agreement_through_a_live_store() -> None:
    shared = dist.HashStore()
    ledgers = [Ledger(lambda: shared, "p", rank=r, world_size=2) for r in (0, 1)]
    shared.set("p/agree1/1", "7")  # the peer has said its value
    assert ledgers[0].agree(3, seconds=5) == [3, 7]
