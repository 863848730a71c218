"""How bench/compare.py times a step, in process: from one barrier to the next, so the
barrier a step ends with is part of it. A barrier waits for what the last step left in
flight on the same connections (ours at stages 1-2 gathers the updated parameters after
``step()`` returns); untimed, it hid that gather's link time, and a step of zs_zero1 across
a 1 Gbit/s link came out shorter than its own bytes at the link's rate (2026-11-29)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compare  # noqa: E402

BARRIER_S = 0.05  # what the barrier waits for here: the last step's gather, say


class Idle:
    """A system whose own work takes no time."""

    def zero_grad(self) -> None:
        pass

    def forward_backward(self, x: Any) -> float:
        return 0.0

    def step(self) -> None:
        pass

    def state_bytes(self) -> dict[str, int]:
        return {}


def test_a_step_is_timed_from_one_barrier_to_the_next(monkeypatch: Any) -> None:
    monkeypatch.setattr(dist, "barrier", lambda: time.sleep(BARRIER_S))
    out = compare.train(Idle(), [None] * 3, census_step=1, warmup=1)
    # each step waited BARRIER_S at one barrier and did nothing else: counted once
    assert len(out["step_s"]) == 3
    assert all(BARRIER_S <= s < 2 * BARRIER_S for s in out["step_s"]), out["step_s"]
    # forward+backward alone holds no barrier
    assert all(s < BARRIER_S for s in out["fwd_bwd_s"]), out["fwd_bwd_s"]
