"""Every system across a shaped link, beside its overlapped floor and the prediction.

For each layout (nodes x processes), link rate and regime of ``bench/compare.py``, one
cluster of ``bench/cluster.py`` is built and, in it:

- the link's rate is measured (a raw TCP transfer both ways at once, interface counters);
- the parts of a step are measured on the regime's model with every process at once, as
  in a real run: forward+backward of the same batch (no communication), and AdamW on the
  whole model, on a 1/N shard and on a 1/P shard (a hybrid system's group);
- each system trains (``bench/compare.py`` under torchrun on every node), and the bytes
  its node's link carried per timed step are read from the interface counters.

A system's floor is ``max(link bytes / link rate, forward+backward) + its optimizer step``
(its share of AdamW), and its step is reported as a multiple of it; beside it, the bytes
and the step ``zero_strategy.perf`` predicts from the same link rate and parts. The systems
run in ``--rounds`` interleaved rounds (each round measures the parts again, then every
system once); a row is the median over rounds. One command makes the JSON, the page and the
README's rows::

    sudo OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python bench/cluster_bench.py \\
        --json bench/results/cluster-<date>.json --page docs/performance/cluster-<date>.md
    python bench/cluster_bench.py --from-json bench/results/cluster-<date>.json --page PAGE.md

bench/README.md ("Across a link") says what every figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings when imported by tests

import cluster as box  # noqa: E402
import cluster_page  # noqa: E402

LAYOUTS = {"2x1": (2, 1), "2x2": (2, 2)}
RATES = ("1gbit", "2gbit")
REGIMES = ("throughput", "memory")
# Per layout: the anchors (DDP, FSDP2, DeepSpeed ZeRO-3 and what it runs of ZeRO++ on a CPU)
# and ours. Hybrid systems need more than one process per node.
SYSTEMS = {
    "2x1": ["ddp", "fsdp2_zero3", "ds_zero3", "ds_zero3_qwz", "ds_zero3_qgz",
            "zs_zero1", "zs_zero2", "zs_zero3", "zs_zero3_unchecked", "zs_zero3_int8"],
    "2x2": ["ddp", "fsdp2_zero3", "fsdp2_hsdp", "ds_zero3", "ds_zero3_hpz",
            "zs_zero1", "zs_zero2", "zs_zero3", "zs_zero3_int8", "zs_zero3_hpz",
            "zs_zero3_hpz_int8"],
}
TIMEOUT = {"throughput": 600.0, "memory": 1200.0}


# -- the parts of a step (run by torchrun on every node) ---------------------------------------

def parts_worker(regime_name: str, out: Path, repeats: int) -> None:
    """Forward+backward of this rank's batch with every rank at once, and AdamW steps on
    the whole model, a 1/N shard and a 1/P shard; rank 0 writes the medians of the slowest
    rank."""
    import compare
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    regime = compare.REGIMES[regime_name]
    model = compare.build_model(regime)
    numel = sum(p.numel() for p in model.parameters())
    batches = compare.make_batches(regime, rank, repeats + 1)

    def fwd_bwd(i: int) -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=batches[i], labels=batches[i]).loss.backward()

    def adamw(n: int) -> Any:
        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.full((n,), 1e-3)
        return torch.optim.AdamW([p], **compare.ADAMW).step

    timed = {"fwd_bwd_s": _timed(fwd_bwd, repeats), "codec_s": _codec(numel, repeats)}
    model.zero_grad(set_to_none=True)
    for key, n in (("adamw_full_s", numel), ("adamw_world_s", -(-numel // world)),
                   ("adamw_local_s", -(-numel // local))):
        step = adamw(n)
        timed[key] = _timed(lambda _, step=step: step(), repeats)
        del step
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, timed)
    if rank == 0:
        record = {k: statistics.median(max(r[k][i] for r in ranks) for i in range(repeats))
                  for k in timed}
        record.update(n_params=numel, world_size=world, per_node=local)
        out.write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _codec(numel: int, repeats: int) -> list[float]:
    """Seconds of one int8 encode or decode (their mean) over the model's element count."""
    import torch

    from zero_strategy.comm import int8

    values = torch.randn(numel)
    blocks = int8.blocks(numel)
    payload = torch.empty(blocks * int8.BLOCK, dtype=torch.int8)
    scales = torch.empty(blocks)
    scratch = torch.empty(int8.scratch_numel(numel, values.device))
    out = torch.empty(numel)

    def both(_: int) -> None:
        int8.encode(values, payload, scales, scratch)
        int8.decode(payload, scales, out)

    return [t / 2 for t in _timed(both, repeats)]


def _timed(fn: Any, repeats: int) -> list[float]:
    """Seconds of each call after one untimed warm-up; every rank starts each call together."""
    import torch.distributed as dist

    times = []
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        fn(i)
        if i:
            times.append(time.perf_counter() - start)
    return times


# -- the driver -----------------------------------------------------------------------------

def run_one(cluster: box.Cluster, command: list[str], out: Path, logs: Path,
            timeout: float) -> dict[str, Any]:
    """One launch on every node; its record, or what stopped it."""
    load = box.loadavg()
    result = cluster.run(command, logs, timeout=timeout,
                         env={"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
                              "TRANSFORMERS_VERBOSITY": "error"})
    record: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"ok": False}
    if not out.exists():
        codes = result["returncodes"]
        why = "timed out" if None in codes else f"exit codes {codes}"
        record["error"] = f"{why}: {_last_error(logs)}"
    record.update(loadavg_before=load, loadavg_after=box.loadavg(), logs=str(logs),
                  launch_s=result["seconds"], links_whole_run=result["links"])
    return record


def _last_error(logs: Path) -> str:
    """The last line naming an exception in any node's log: a rank's own (torchrun prefixes
    it with ``[rankN]:``), not torchrun's ``ChildFailedError`` that reports it."""
    found = ""
    for log in sorted(logs.glob("node*.log")):
        for line in log.read_text(errors="replace").splitlines():
            text = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())
            if ("Error" in text or "Exception" in text) and ":" in text and not \
                    text.startswith(("File ", "raise ", "error_file")) and \
                    "ChildFailedError" not in text:
                found = text
    return found[:400] or "no error in the logs"


def run_parts(cluster: box.Cluster, regime: str, work: Path, repeats: int) -> dict[str, Any]:
    out = work / f"parts-{regime}-{time.monotonic_ns()}.json"
    command = [__file__, "--parts", regime, "--parts-out", str(out),
               "--repeats", str(repeats)]
    return run_one(cluster, command, out, out.with_suffix(""), TIMEOUT[regime])


def run_system(cluster: box.Cluster, system: str, regime: str, work: Path,
               opts: argparse.Namespace) -> dict[str, Any]:
    stem = f"{system}-{regime}-{time.monotonic_ns()}"
    out = work / f"{stem}.json"
    command = [str(Path(__file__).parent / "compare.py"), "--system", system, "--regime",
               regime, "--precision", "fp32", "--out", str(out)]
    if opts.steps:
        command += ["--steps", str(opts.steps)]
    record = run_one(cluster, command, out, work / stem, TIMEOUT[regime])
    record.setdefault("system", system)
    record.setdefault("regime", regime)
    step = f"{record['median_step_s']:.3f} s/step" if record.get("ok") else record["error"]
    print(f"  {system} {regime}: {step}", flush=True)
    return record


def measure_cell(layout: str, rate: str, opts: argparse.Namespace, work: Path
                 ) -> list[dict[str, Any]]:
    """One cluster: the link's rate, then per regime and round the parts and every system."""
    nodes, per_node = LAYOUTS[layout]
    systems = [s for s in SYSTEMS[layout] if not opts.systems or s in opts.systems]
    rows: list[dict[str, Any]] = []
    with box.Cluster(nodes, per_node, rate, prefix=opts.prefix) as cluster:
        link = cluster.measure_rate(opts.rate_seconds)
        print(f"{layout} {rate}: link {link['bytes_per_s'] / 1e6:.1f} MB/s each way", flush=True)
        for regime in opts.regimes:
            for round_ in range(opts.rounds):
                parts = run_parts(cluster, regime, work, opts.repeats)
                # interleaved: each round runs the systems in another order
                shift = round_ % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    record = run_system(cluster, system, regime, work, opts)
                    rows.append({"layout": layout, "rate": rate, "round": round_,
                                 "link": link, "parts": parts, **record})
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="of: " + ", ".join(LAYOUTS))
    p.add_argument("--rates", default=",".join(RATES))
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--systems", default="", help="a subset (default: every one per layout)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: compare.py's)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions of each part")
    p.add_argument("--rate-seconds", type=float, default=3.0)
    p.add_argument("--prefix", default="zsbox", help="the clusters' namespace prefix")
    p.add_argument("--workdir", default=None, help="records and logs (default: a temp folder)")
    p.add_argument("--json", type=Path, help="every row, with its parts and link")
    p.add_argument("--page", type=Path, help="the markdown page")
    p.add_argument("--readme", type=Path, default=None,
                   help="rewrite this README's cluster rows (default: none)")
    p.add_argument("--from-json", type=Path, help="only render --page from a JSON of a run")
    p.add_argument("--note", action="append", default=[], help="a line for the page")
    p.add_argument("--parts", help=argparse.SUPPRESS)
    p.add_argument("--parts-out", type=Path, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    for name, known in (("layouts", LAYOUTS), ("regimes", REGIMES)):
        values = [v for v in getattr(opts, name).split(",") if v]
        unknown = [v for v in values if v not in known]
        if unknown or not values:
            p.error(f"--{name}: unknown {unknown or '(none)'}; known: {', '.join(known)}")
        setattr(opts, name, values)
    opts.rates = [r for r in opts.rates.split(",") if r]
    for rate in opts.rates:
        try:
            box.rate_bits(rate)
        except ValueError as e:
            p.error(f"--rates: {e}")
    opts.systems = [s for s in opts.systems.split(",") if s]
    every = {s for names in SYSTEMS.values() for s in names}
    if set(opts.systems) - every:
        p.error(f"--systems: unknown {sorted(set(opts.systems) - every)}; known: "
                f"{', '.join(sorted(every))}")
    if opts.rounds < 1 or opts.repeats < 1:
        p.error("--rounds and --repeats must be at least 1")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.parts:
        parts_worker(opts.parts, opts.parts_out, opts.repeats)
        return 0
    if opts.from_json:
        data = json.loads(opts.from_json.read_text())
        cluster_page.write(data, opts.page, opts.readme)
        return 0
    why = box.missing_requirements()
    if why:
        print(f"error: the cluster bench {why}", file=sys.stderr)
        return 2
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="zs-cluster-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"records and logs in {work}", flush=True)
    start = time.perf_counter()
    data: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%d %H:%M"), "notes": opts.note,
        "command": "python " + shlex.join(["bench/cluster_bench.py", *(argv or sys.argv[1:])]),
        "loadavg_before": box.loadavg(), "rows": []}
    with box.stopped_by_signals():
        for layout in opts.layouts:
            for rate in opts.rates:
                data["rows"] += measure_cell(layout, rate, opts, work)
                if opts.json:  # what is measured so far survives a later failure
                    cluster_page.save_json(data, opts.json)
    data["minutes"] = (time.perf_counter() - start) / 60
    data["loadavg_after"] = box.loadavg()
    if opts.json:
        cluster_page.save_json(data, opts.json)
    cluster_page.write(data, opts.page, opts.readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
