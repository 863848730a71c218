"""Where a step leaves the link idle: a node's link counters sampled every millisecond beside
what the main thread was doing then (the engine's ``zero::`` scopes from torch.profiler),
over a few steps of bench/compare.py's work, on a node of bench/cluster.py.

    sudo OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python bench/cluster.py --nodes 2 --nproc 1 \\
        --rate 1gbit -- bench/link_timeline.py --system zs_zero3 --out timeline.json

Rank 0 of each node samples its node's link. Per timed step the record has: the step's
seconds; the link's busy time (1-ms samples moving more than a fifth of the fastest 10 ms
seen, either way) and bytes; and every idle stretch of 3 ms or more with the scope the main
thread was in, so a stretch under ``timeline::forward_backward`` with no ``zero::`` scope
open is link time lost to compute that a gather or reduction could have overlapped, and one
under ``timeline::step`` is the optimizer's (the floor's ``+ optimizer``). A diagnostic,
not a benchmark: the profiler and the sampler cost a few percent of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import compare
from cluster import link_counters

IDLE_MS = 3  # shorter stretches are the sampler's jitter and TCP's acknowledgements


class Sampler(threading.Thread):
    """(perf_counter ns, sent, received) every millisecond until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[int, int, int]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            c = link_counters()
            if c is None:
                return
            self.samples.append((time.perf_counter_ns(), c["sent"], c["received"]))
            time.sleep(0.001)


def scopes(prof: Any, origin_us: float, origin_ns: int) -> list[tuple[int, int, str]]:
    """The main thread's ``zero::`` and ``timeline::`` ranges, in perf_counter ns."""
    out = []
    for e in prof.events():
        if e.name.startswith(("zero::", "timeline::")) and e.name != "timeline::origin":
            start = origin_ns + int((e.time_range.start - origin_us) * 1000)
            out.append((start, start + int(e.time_range.elapsed_us() * 1000), e.name))
    return out


def innermost(spans: list[tuple[int, int, str]], t: int) -> str:
    inside = [s for s in spans if s[0] <= t < s[1]]
    if not inside:
        return "between steps"
    return min(inside, key=lambda s: s[1] - s[0])[2]


def summarize(samples: list[tuple[int, int, int]], spans: list[tuple[int, int, str]]
              ) -> list[dict[str, Any]]:
    rates = [max(b[1] - a[1], b[2] - a[2]) / max(b[0] - a[0], 1) for a, b in
             zip(samples[::10], samples[10::10])]  # bytes per ns over ~10 ms
    busy_rate = 0.2 * max(rates, default=0.0)
    steps = sorted((s for s in spans if s[2] == "timeline::step"), key=lambda s: s[0])
    out = []
    for start, end, _ in steps:
        inside = [s for s in samples if start <= s[0] <= end]
        busy = 0
        idle: list[list[Any]] = []
        for a, b in zip(inside, inside[1:]):
            dt = b[0] - a[0]
            moved = max(b[1] - a[1], b[2] - a[2])
            if moved > busy_rate * dt:
                busy += dt
            elif idle and idle[-1][1] == a[0]:
                idle[-1][1] = b[0]
            else:
                idle.append([a[0], b[0], innermost(spans, a[0])])
        stretches = [(a, b, where) for a, b, where in idle if b - a >= IDLE_MS * 1e6]
        by_scope: dict[str, float] = defaultdict(float)
        for a, b, where in stretches:
            by_scope[where] += (b - a) / 1e9
        out.append({
            "step_s": (end - start) / 1e9,
            "busy_s": busy / 1e9,
            "bytes": {"sent": inside[-1][1] - inside[0][1],
                      "received": inside[-1][2] - inside[0][2]} if inside else {},
            "idle_by_scope_s": dict(sorted(by_scope.items(), key=lambda kv: -kv[1])),
            "idle": [[round((a - start) / 1e6, 1), round((b - a) / 1e6, 1), where]
                     for a, b, where in stretches],
            "waits_s": {name: sum(e - s for s, e, n in spans if n == name and start <= s < end)
                        / 1e9 for name in ("zero::gather", "zero::gather_for_backward",
                                           "zero::end_backward", "zero::reduce")},
        })
    return out


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    regime = compare.REGIMES[args.regime]
    rank = dist.get_rank()
    system = compare.build_system(args.system, compare.build_model(regime), regime,
                                  compare.Variant())
    batches = compare.make_batches(regime, rank, args.warmup + args.steps)
    sampling = int(os.environ.get("LOCAL_RANK", "0")) == 0 and link_counters() is not None
    sampler = Sampler()
    for x in batches[:args.warmup]:
        system.zero_grad()
        system.forward_backward(x)
        system.step()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        origin_ns = time.perf_counter_ns()
        with record_function("timeline::origin"):
            pass
        if sampling:
            sampler.start()
        for x in batches[args.warmup:]:
            dist.barrier()
            with record_function("timeline::step"):
                system.zero_grad()
                with record_function("timeline::forward_backward"):
                    system.forward_backward(x)
                with record_function("timeline::optimizer"):
                    system.step()
        dist.barrier()
        sampler.halt.set()
    if sampling:
        sampler.join()
    origin = next(e for e in prof.events() if e.name == "timeline::origin")
    spans = scopes(prof, origin.time_range.start, origin_ns)
    mine = {"rank": rank, "node": os.environ.get("ZS_CLUSTER_NODE"),
            "steps": summarize(sampler.samples, spans) if sampling else None}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"system": args.system, "regime": args.regime,
                                              "ranks": every}, indent=1))
        for r in every:
            for i, s in enumerate(r["steps"] or []):
                print(f"rank {r['rank']} step {i}: {s['step_s']:.3f} s, link busy "
                      f"{s['busy_s']:.3f} s, idle {s['idle_by_scope_s']}", flush=True)
    if hasattr(getattr(system, "engine", None), "close"):
        system.engine.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", default="zs_zero3", choices=list(compare.SYSTEMS))
    p.add_argument("--regime", default="throughput", choices=list(compare.REGIMES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    run(p.parse_args())


if __name__ == "__main__":
    main()
