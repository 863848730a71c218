"""Tokens per second of ``model.generate()`` on a model trained by the engine: replicated (what
DDP generates with), ZeRO stage 2 (parameters whole, only optimizer state and gradients
sharded) and stage 3 (every forward gathers each unit from all ranks).

Stage 3 is where DeepSpeed's users suffer most at generation (DeepSpeed#4354,
DeepSpeedExamples#718: 72 s at stage 3 against 0.8 s at stage 2); here each generated token
costs one all-gather per unit. Ranks ask for different lengths, as TRL's online trainers'
ranks do, so ``synced_gpus`` keeps the shorter one stepping::

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

SYSTEMS = {"replicated": None, "zs_zero2": 2, "zs_zero3": 3, "zs_zero3_gathered": 3}
"""Stage of each system. ``zs_zero3_gathered`` generates inside ``engine.gathered_parameters()``:
one gather for the whole call, the whole model held meanwhile (what DeepSpeed's
``GatheredParameters`` and TRL's ``unwrap_model_for_generation`` do)."""


def worker(system: str, out: Path, new_tokens: int, width: int, layers: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from zero_strategy import ZeroConfig, ZeroEngine

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=256, n_embd=width,
                                       n_layer=layers, n_head=width // 64)).eval()
    stage = SYSTEMS[system]
    engine = None
    if stage is not None:
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=stage))
    prompt = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(rank))
    mine = new_tokens + 8 * rank  # ranks stop at different lengths
    sent = (lambda: dict(engine.shards.bytes_sent)) if engine else (lambda: {})
    whole = (engine.gathered_parameters if system.endswith("_gathered")
             else contextlib.nullcontext)
    with torch.no_grad():  # warm-up: allocator, gather buffers
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       synced_gpus=stage == 3 and world > 1)
        dist.barrier()
        before, start = sent(), time.perf_counter()
        with whole():
            model.generate(prompt, max_new_tokens=mine, min_new_tokens=mine, do_sample=False,
                           pad_token_id=0, synced_gpus=stage == 3 and world > 1)
        seconds = time.perf_counter() - start
    gathered = sent().get("all_gather", 0) - before.get("all_gather", 0)
    record = {"system": system, "rank": rank, "tokens": mine, "seconds": seconds,
              "tokens_per_s": mine / seconds, "all_gather_bytes": gathered,
              "params": sum(p.numel() for p in model.parameters())}
    (out / f"{system}.{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for system in SYSTEMS:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                       str(args.world), __file__, "--worker", system, "--out", tmp,
                       "--new-tokens", str(args.new_tokens), "--width", str(args.width),
                       "--layers", str(args.layers)]
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            ranks = [json.loads(Path(tmp, f"{system}.{r}.json").read_text())
                     for r in range(args.world)]
            rank0 = ranks[0]
            # The slowest rank's request decides everyone's time under synced_gpus.
            longest = max(r["tokens"] for r in ranks)
            rows.append({"system": system, "params": rank0["params"],
                         "tokens_per_s_rank0": round(rank0["tokens_per_s"], 1),
                         "seconds": round(max(r["seconds"] for r in ranks), 3),
                         "gather_MiB_per_forward": round(
                             rank0["all_gather_bytes"] / longest / 2**20, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--worker", choices=sorted(SYSTEMS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out, args.new_tokens, args.width, args.layers)
        return
    rows = run(args)
    print("| system | params | tokens/s (rank 0) | wall s (slowest rank) | "
          "all-gather MiB sent per forward |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['params']:,} | {r['tokens_per_s_rank0']} | {r['seconds']} "
              f"| {r['gather_MiB_per_forward']} |")


if __name__ == "__main__":
    main()
