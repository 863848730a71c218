"""Turn one run of the shared benchmark into the output file a docs page is generated from.

    python recipes/bench_page.py RUN_DIR docs/performance/runs/2026-11-25.json \
        --command "SYSTEMS=... ../shared/bench/run_anchors.sh" [--note "..."]

RUN_DIR is what ``../shared/bench/run_anchors.sh`` wrote (``anchors-<stamp>/``, one JSON per
system x regime x precision). The output keeps, per run, the figures the page shows (step
time, throughput, peak RSS growth, model-state bytes beside the formula, losses against
DDP's) and the versions, and drops the per-rank detail; ``docs/hooks/bench_pages.py`` renders
it. Runs that failed are kept with their error, so a page never hides one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

KEPT = ("system", "regime", "precision", "world_size", "n_params", "median_step_s",
        "tokens_per_s", "peak_rss_delta_mib_max", "model_state_mib_max", "formula_mib",
        "versions", "time")


def compact(record: dict[str, Any], ddp: dict[tuple[str, str], list[float]]) -> dict[str, Any]:
    if not record.get("ok"):
        return {k: record.get(k) for k in ("system", "regime", "precision")} | {
            "error": str(record.get("summary") or record.get("error") or "failed")[:300]}
    out = {k: record.get(k) for k in KEPT}
    if not out["model_state_mib_max"]:
        # The bench's census cannot tell our engine's flat buffers by kind and counts them as
        # other live tensors: for such a system that count is its model state.
        out["model_state_mib_max"] = record.get("other_tensor_mib_max")
    losses = record["loss_mean_over_ranks"]
    out["first_loss"] = losses[0]
    out["last_loss"] = losses[-1]
    reference = ddp.get((record["regime"], record["precision"]))
    if reference is not None and record["system"] != "ddp":
        out["max_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(losses, reference))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--command", default="")
    parser.add_argument("--note", action="append", default=[])
    args = parser.parse_args()
    records = [json.loads(p.read_text()) for p in sorted(args.run_dir.glob("*.json"))
               if p.name != "prebuild.json"]
    if not records:
        raise SystemExit(f"{args.run_dir}: no run files (*.json)")
    ddp = {(r["regime"], r["precision"]): r["loss_mean_over_ranks"] for r in records
           if r.get("ok") and r["system"] == "ddp"}
    regimes = {"throughput": 0, "memory": 1}
    systems = ["ddp", "torch_zero1", "fsdp2", "ds_", "zs_"]  # anchors first, ours last

    def place(r: dict[str, Any]) -> tuple[Any, ...]:
        family = next((i for i, s in enumerate(systems) if r["system"].startswith(s)), 9)
        return regimes.get(r["regime"], 2), r["precision"], family, r["system"]

    runs = sorted((compact(r, ddp) for r in records), key=place)
    page = {"created": time.strftime("%Y-%m-%d %H:%M"), "command": args.command,
            "notes": args.note, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(page, indent=1) + "\n")
    print(f"{len(runs)} runs -> {args.out}")


if __name__ == "__main__":
    main()
