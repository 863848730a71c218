"""How bench/compare.py times a step, in process: steps back to back, a barrier before
the first and after the last, the final one counted in the last step, so the steps add up
to the loop's time. Until 2026-11-29 each step began after an untimed barrier of its own,
and a barrier waits for what the last step left in flight (ours at stages 1-2 gathers the
updated parameters after ``step()`` returns): a step of zs_zero1 across a 1 Gbit/s link
came out shorter than its own bytes at the link's rate."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compare  # noqa: E402

IN_FLIGHT_S = 0.05  # what a step leaves in flight: a gather of updated parameters, say


class Slow:
    """A system whose step leaves work in flight that the next barrier waits for (as a
    gather of updated parameters would), and that the next forward waits for otherwise."""

    def __init__(self) -> None:
        self.pending_until = 0.0

    def _wait_pending(self) -> None:
        time.sleep(max(0.0, self.pending_until - time.perf_counter()))

    def zero_grad(self) -> None:
        pass

    def forward_backward(self, x: Any) -> float:
        self._wait_pending()
        return 0.0

    def step(self) -> None:
        self.pending_until = time.perf_counter() + IN_FLIGHT_S

    def state_bytes(self) -> dict[str, int]:
        return {}


def test_steps_add_up_to_the_loop_and_count_what_they_leave_in_flight(monkeypatch: Any) -> None:
    system = Slow()
    barriers: list[float] = []

    def barrier() -> None:  # waits for what is in flight, as gloo's would behind a gather
        barriers.append(time.perf_counter())
        system._wait_pending()

    monkeypatch.setattr(dist, "barrier", barrier)
    start = time.perf_counter()
    out = compare.train(system, [None] * 4, census_step=1, warmup=1)
    loop = time.perf_counter() - start
    # one barrier before the loop, one after it, and one where the timed steps begin (so
    # the link's counted bytes start with nothing in flight): none between timed steps to
    # hide a wait in
    assert len(barriers) == 3
    # every step's in-flight work is waited for once, somewhere: the warm-up step's at the
    # barrier before the timed steps (in its own time), each timed step's in the next
    # step's forward, the last one's at the final barrier
    steps = out["step_s"]
    assert steps[0] >= IN_FLIGHT_S and steps[1] < IN_FLIGHT_S, steps
    assert all(s >= IN_FLIGHT_S for s in steps[2:]), steps
    assert sum(out["step_s"]) == pytest.approx(loop, abs=0.02)
    assert sum(out["step_s"]) >= 4 * IN_FLIGHT_S
