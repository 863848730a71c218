"""Tokens per second of ``model.generate()`` on a model trained by the engine: replicated (what
DDP generates with), ZeRO stage 2 (parameters whole, only optimizer state and gradients
sharded) and stage 3, whose ``generate()`` runs in the engine's generation mode.

Stage 3 is where DeepSpeed's users suffer most at generation (DeepSpeed#4354,
DeepSpeedExamples#718: 72 s at stage 3 against 0.8 s at stage 2). Here, by default, each
unit is gathered once per ``generate()`` call and held (the model fits the default budget,
free memory): (N-1)/N of the model's bytes per call. ``zs_zero3_streamed`` sets
``generation_gather_budget=0``, what every stage-3 call did before: each unit gathered per
forward, (N-1)/N of the model's bytes per token, with ``synced_gpus`` keeping the shorter
request stepping (ranks ask for different lengths, as TRL's online trainers' ranks do)::

    OMP_NUM_THREADS=1 python bench/generate_bench.py            # 2 processes, prints a table

One ``torch.distributed.run`` of this script's worker mode per system; greedy decoding, fp32,
CPU (gloo). Compare rows of one run only: the machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = {"replicated": None, "zs_zero2": 2, "zs_zero3": 3, "zs_zero3_streamed": 3,
           "zs_zero3_gathered": 3}
"""Stage of each system. ``zs_zero3_gathered`` generates inside ``engine.gathered_parameters()``
by hand (what DeepSpeed's ``GatheredParameters`` does; the mode makes it unnecessary)."""
BUDGETS = {"zs_zero3_streamed": 0}
"""``ZeroConfig.generation_gather_budget`` of a system (others: the default)."""


def worker(system: str, out: Path, new_tokens: int, width: int, layers: int,
           repeat: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from zero_strategy import ZeroConfig, ZeroEngine
    from zero_strategy.core.generation import gathered_bytes

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=256, n_embd=width,
                                       n_layer=layers, n_head=width // 64)).eval()
    stage = SYSTEMS[system]
    engine = None
    if stage is not None:
        budget = {"generation_gather_budget": BUDGETS[system]} if system in BUDGETS else {}
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()),
                            ZeroConfig(stage=stage, **budget))
    prompt = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(rank))
    mine = new_tokens + 8 * rank  # ranks stop at different lengths
    sent = (lambda: dict(engine.shards.bytes_sent)) if engine else (lambda: {})
    whole = (engine.gathered_parameters if system.endswith("_gathered")
             else contextlib.nullcontext)
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    # synced_gpus left unset: the engine sets it while some unit streams
    with torch.no_grad():  # warm-up: allocator, gather buffers
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
        runs = []  # (seconds, all-gather bytes, forwards) of each timed call
        for _ in range(repeat):  # the fastest counts: the machine is shared
            dist.barrier()
            before, start, forwards[:] = sent(), time.perf_counter(), []
            with whole():
                model.generate(prompt, max_new_tokens=mine, min_new_tokens=mine,
                               do_sample=False, pad_token_id=0)
            runs.append((time.perf_counter() - start,
                         sent().get("all_gather", 0) - before.get("all_gather", 0),
                         len(forwards)))
    seconds, gathered, _ = min(runs)
    # What one call's all-gathers carry: the gathered units' whole buffers (parameters below
    # param_persistence_threshold stay whole on every rank and are never gathered).
    model_bytes = (sum(gathered_bytes(u) for u in engine.units if u.param_store.gathers)
                   if engine is not None else 0)
    record = {"system": system, "rank": rank, "tokens": mine, "seconds": seconds,
              "tokens_per_s": mine / seconds, "all_gather_bytes": gathered,
              "forwards": runs[0][2], "world": world, "model_bytes": model_bytes,
              "params": sum(p.numel() for p in model.parameters())}
    (out / f"{system}.{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def formula_bytes(system: str, record: dict) -> float:
    """What the call's all-gathers should send from a rank: (N-1)/N of the model's bytes once
    (held for the call) or once per forward (streamed), nothing replicated or at stage 2."""
    n = record["world"]
    if SYSTEMS[system] != 3:
        return 0.0
    gathers = record["forwards"] if system in BUDGETS else 1
    return (n - 1) / n * record["model_bytes"] * gathers


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for system in SYSTEMS:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                       str(args.world), __file__, "--worker", system, "--out", tmp,
                       "--new-tokens", str(args.new_tokens), "--width", str(args.width),
                       "--layers", str(args.layers), "--repeat", str(args.repeat)]
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            ranks = [json.loads(Path(tmp, f"{system}.{r}.json").read_text())
                     for r in range(args.world)]
            rank0 = ranks[0]
            rows.append({"system": system, "params": rank0["params"],
                         "tokens_per_s_rank0": round(rank0["tokens_per_s"], 1),
                         "seconds": round(max(r["seconds"] for r in ranks), 3),
                         "forwards_rank0": rank0["forwards"],
                         "gather_MiB_per_token": round(
                             rank0["all_gather_bytes"] / rank0["tokens"] / 2**20, 3),
                         "formula_MiB_per_token": round(
                             formula_bytes(system, rank0) / rank0["tokens"] / 2**20, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed generate() calls per system; the fastest is reported")
    parser.add_argument("--worker", choices=sorted(SYSTEMS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out, args.new_tokens, args.width, args.layers, args.repeat)
        return
    rows = run(args)
    print("| system | params | tokens/s (rank 0) | wall s (slowest rank) | forwards (rank 0) | "
          "all-gather MiB sent per token (rank 0) | formula |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['params']:,} | {r['tokens_per_s_rank0']} | {r['seconds']} "
              f"| {r['forwards_rank0']} | {r['gather_MiB_per_token']} "
              f"| {r['formula_MiB_per_token']} |")


if __name__ == "__main__":
    main()
