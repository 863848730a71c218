"""The largest GPT-2 (by layer count) that trains a step on one GPU, plain stage 3 against
zero3_offload, with the step time and model TFLOPS of each.

    python bench/gpu_capacity.py [--width 1600 --heads 25 --seq 1024 --batch 1]
        [--layers 12,24,48,96,144,192,256] [--timeout 900] [--out capacity.json]

Each (mode, layers) trial runs in its own process (an out-of-memory error cannot poison the
next one): the model is built on the meta device and materialised one unit at a time by the
engine, trains three bf16-mixed AdamW steps, and reports the last step's time. A mode stops
at its first failure; the largest success is reported, so the answer is as fine as the
``--layers`` grid. TFLOPS count 6 x parameters x tokens per step (attention's own FLOPs
excluded, as usual for this figure).

Each trial also checks its GPU memory after the step, when activations are gone, against the
ZeRO formula's device bytes (``engine.predicted_memory()``): plain stage 3 must hold between
0.9x and 1.5x of it (the rest: the pool's gradient blocks of the largest units, a unit the
next forward prefetched). Offloaded runs keep almost nothing on the GPU, so their ratio is
reported only. A run outside the bound makes the command exit 1, naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

MODES = {"zero3": {"stage": 3}, "zero3_offload": {"stage": 3, "offload_optimizer": True,
                                                   "offload_params": True}}


def trial(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import zero_strategy as zs

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    config = GPT2Config(n_layer=args.n_layer, n_embd=args.width, n_head=args.heads,
                        n_positions=args.seq, vocab_size=50257)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-5),
                           zs.ZeroConfig(precision="bf16-mixed", **MODES[args.mode]),
                           device="cuda")
    ids = torch.randint(0, 50257, (args.batch, args.seq), device="cuda")
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    tokens = args.batch * args.seq
    final_loss = float(loss)
    del loss
    torch.cuda.synchronize()
    predicted = engine.predicted_memory()
    formula = predicted.total_bytes - predicted.host_bytes
    ratio = (torch.cuda.memory_allocated() - base) / formula if formula else float("nan")
    return {"mode": args.mode, "layers": args.n_layer, "params": params,
            "step_s": times[-1], "tflops": 6 * params * tokens / times[-1] / 1e12,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": final_loss,
            "formula_device_gib": formula / 2**30, "states_to_formula": ratio,
            "within_formula": args.mode != "zero3" or 0.9 <= ratio <= 1.5}


def search(args: argparse.Namespace) -> dict[str, Any]:
    grid = [int(x) for x in args.layers.split(",")]
    report: dict[str, Any] = {"width": args.width, "seq": args.seq, "batch": args.batch,
                              "grid": grid, "modes": {}}
    for mode in MODES:
        best, tried = None, []
        for layers in grid:
            cmd = [sys.executable, __file__, "--trial", "--mode", mode, "--n-layer",
                   str(layers), "--width", str(args.width), "--heads", str(args.heads),
                   "--seq", str(args.seq), "--batch", str(args.batch)]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                ok = run.returncode == 0
                outcome = json.loads(run.stdout.strip().splitlines()[-1]) if ok else {
                    "layers": layers, "failed": (run.stderr.strip().splitlines() or ["?"])[-1]}
            except subprocess.TimeoutExpired:
                ok, outcome = False, {"layers": layers, "failed": f"over {args.timeout} s"}
            tried.append(outcome)
            print(json.dumps(outcome), flush=True)
            if not ok:
                break
            best = outcome
        report["modes"][mode] = {"largest": best, "tried": tried}
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=sorted(MODES), default="zero3")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--layers", default="12,24,48,96,144,192,256")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--heads", type=int, default=25)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.trial:
        print(json.dumps(trial(args)))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = search(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    off = [t for mode in report["modes"].values() for t in mode["tried"]
           if t.get("within_formula") is False]
    if off:
        sys.exit(f"GPU memory after the step is not within 0.9-1.5x of the ZeRO formula: "
                 f"{json.dumps(off)}")


if __name__ == "__main__":
    main()
