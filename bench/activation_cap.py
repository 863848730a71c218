"""How large a model trains on the disk tier inside a memory cap, with and without activation
checkpointing (and the checkpointed inputs on disk).

    OMP_NUM_THREADS=1 python bench/activation_cap.py --offload-dir /var/tmp/zs-offload \\
        --cap-gib 1 --layers 36,192 [--seq 32] [--steps 2] [--json out.json]

For each layer count, runs ``bench/disk_bench.py --tier disk`` (the shared bench's
memory-regime GPT-2 with ``n_layer`` layers: width 1024, 16 heads, vocabulary 16384, N=1,
stage 3, both tiers on "disk") in a fresh process inside a fresh memory cgroup of
``--cap-gib``, once as it is and once with ``activation_checkpointing=True,
offload_activations="disk"``. Each run reports whether it trained or was OOM-killed, its
step times, the cgroup's peak usage, the growth of the process's anonymous memory, the
activations the engine measured (``memory_report()["activation_bytes"]``) beside the
formula's (``zs.estimate_activations``), and the model-state window the ZeRO formula
predicts. Needs root and cgroup v1's memory controller (as
tests/integration/test_disk_cap.py); each run takes minutes at hundreds of layers (the
step reads and writes 16 bytes per parameter).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CGROUPS = Path("/sys/fs/cgroup/memory")


def run_capped(layers: int, checkpointing: bool, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix="zs-cap-")) / "run.json"
    group = CGROUPS / f"zero_strategy_cap_{uuid.uuid4().hex[:8]}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(int(args.cap_gib * (1 << 30))))
    cmd = [sys.executable, str(ROOT / "bench" / "disk_bench.py"), "--tier", "disk",
           "--steps", str(args.steps), "--layers", str(layers), "--seq", str(args.seq),
           "--json", str(out)]
    if args.offload_dir:
        cmd += ["--offload-dir", args.offload_dir]
    if checkpointing:
        cmd += ["--checkpointing", "--offload-activations", "disk"]
    # joins the group before Python starts, so every byte the process touches counts
    capped = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run(capped, env=env, capture_output=True, text=True)
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        oom = dict(line.split() for line in (group / "memory.oom_control").read_text()
                   .splitlines()).get("oom_kill", "0")
    finally:
        group.rmdir()
    result = {"layers": layers, "checkpointing": checkpointing, "returncode": done.returncode,
              "oom_kills": int(oom), "cgroup_peak": peak, "trained": done.returncode == 0}
    if done.returncode == 0:
        run = json.loads(out.read_text())
        report = run["memory_report"]
        result.update(
            params=run["params"], step_s=run["step_s"], losses=run["losses"],
            added_resident=run["peak_resident"] - run["baseline_resident"],
            baseline_resident=run["baseline_resident"],
            predicted_window=report["predicted_resident_bytes"],
            activation_bytes=report["activation_bytes"],
            offloaded_activation_bytes=report["offloaded_activation_bytes"],
            predicted_activations=run["predicted_activations"])
    else:
        result["stderr"] = done.stderr[-2000:]
    return result


def describe(r: dict) -> str:
    mib = 1 << 20
    kind = "checkpointed + offload" if r["checkpointing"] else "plain"
    label = f"{r['layers']:4d} layers, {kind:22s}"
    if not r["trained"]:
        why = "OOM-killed" if r["oom_kills"] else f"failed (returncode {r['returncode']})"
        return f"{label} {why}, cgroup peak {r['cgroup_peak'] / mib:.0f} MiB"
    pred = r["predicted_activations"]
    return (f"{label} {r['params'] / 1e6:.0f} M params: trained, steps "
            f"{', '.join(f'{s:.1f}' for s in r['step_s'])} s; cgroup peak "
            f"{r['cgroup_peak'] / mib:.0f} MiB, anonymous memory +{r['added_resident'] / mib:.0f}"
            f" MiB (window predicted {r['predicted_window'] / mib:.0f} MiB); activations "
            f"measured {r['activation_bytes'] / mib:.2f} MiB kept + "
            f"{r['offloaded_activation_bytes'] / mib:.2f} MiB on disk, formula "
            f"{pred['saved_bytes'] / mib:.2f} MiB (peak {pred['peak_bytes'] / mib:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--cap-gib", type=float, default=1.0)
    parser.add_argument("--layers", default="36,192", help="comma-separated layer counts")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", choices=["plain", "checkpointed"], default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if os.geteuid() != 0 or not (CGROUPS / "memory.limit_in_bytes").exists():
        sys.exit("needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory")
    results = []
    for layers in (int(n) for n in args.layers.split(",")):
        for checkpointing in (False, True):
            if args.only and args.only != ("checkpointed" if checkpointing else "plain"):
                continue
            results.append(run_capped(layers, checkpointing, args))
            print(describe(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
