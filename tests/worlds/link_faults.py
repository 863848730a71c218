"""One rank of a stage-3 job across the nodes of ``bench/cluster.py``, meeting a fault: run by
tests/integration/test_link_faults.py under torchrun on every node.

The job trains a stack of 1024 x 1024 linear layers (one gather unit each) for ``--steps``
steps with ``ZeroConfig(timeout=--timeout)``; after each step a rank writes how many it
finished (``progress<rank>``), so the test can cut the link at a known step. ``--kill
WHERE:N`` makes the last rank SIGKILL itself, as a peer that dies, the N-th time it
reaches WHERE:

- ``gather_sent`` / ``reduce_sent``: right after posting its sends of an all-gather /
  reduce-scatter (its peers are then receiving from it, and sending to it);
- ``gather_posting``: before posting an all-gather's (its peers wait for bytes that never
  come);
- ``forward``: in the middle of a forward, between two units (its peers wait in a gather).

A rank that raises writes its last exception (the one that ends the script) to
``final<rank>.json``: type, message, and the type and message of its ``__cause__``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zero_strategy as zs
from zero_strategy.comm.collectives import Communicator

WIDTH, LAYERS = 1024, 6
POINTS = {"gather_sent": ("_gather_rows", "after"), "gather_posting": ("_gather_rows", "before"),
          "reduce_sent": ("_reduce_scatter_direct", "after"), "forward": (None, "before")}


def killer(count: int) -> Callable[[], None]:
    """A function that SIGKILLs this process on its ``count``-th call."""
    calls = [0]

    def hit() -> None:
        calls[0] += 1
        if calls[0] == count:
            os.kill(os.getpid(), signal.SIGKILL)

    return hit


def arm(net: torch.nn.Module, where: str, count: int) -> None:
    if where not in POINTS:
        raise SystemExit(f"--kill: {where!r} is not one of {sorted(POINTS)}")
    hit = killer(count)
    method, when = POINTS[where]
    if method is None:  # the forward of the middle layer
        net[LAYERS // 2].register_forward_pre_hook(lambda *_: hit())
        return
    original = getattr(Communicator, method)

    def patched(self: Communicator, *args: Any, **kwargs: Any) -> Any:
        if when == "before":
            hit()
        out = original(self, *args, **kwargs)
        if when == "after":
            hit()
        return out

    setattr(Communicator, method, patched)


def train(opts: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    if opts.kill and rank == world - 1:
        where, count = opts.kill.split(":")
        arm(net, where, int(count))
    engine = zs.ZeroEngine(net, torch.optim.AdamW(net.parameters(), lr=1e-3),
                           zs.ZeroConfig(stage=3, timeout=opts.timeout))
    gen = torch.Generator().manual_seed(rank)
    for step in range(opts.steps):
        x = torch.randn(8, WIDTH, generator=gen)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        (opts.out / f"progress{rank}").write_text(str(step + 1))


def describe(error: BaseException) -> dict[str, Any]:
    cause = error.__cause__
    return {"type": type(error).__name__, "message": str(error),
            "cause_type": type(cause).__name__ if cause else None,
            "cause": str(cause) if cause else None,
            "traceback": "".join(traceback.format_exception(error))[-4000:]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--kill", default=None, help="WHERE:N, on the last rank")
    opts = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=opts.timeout))
    rank = dist.get_rank()
    try:
        train(opts)
    except BaseException as e:  # noqa: BLE001 - what ends the script is the record
        (opts.out / f"final{rank}.json").write_text(json.dumps(describe(e)))
        raise
    (opts.out / f"final{rank}.json").write_text(json.dumps({"type": None}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
