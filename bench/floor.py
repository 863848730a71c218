"""What each ZeRO stage's step could cost at best on this machine and model, and what it costs.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/floor.py \
        [--layers 4 --width 512 --heads 8 --vocab 8192 --seq 128 --batch 4]
        [--steps 6] [--stages 0,1,2,3] [--out f.json]

Measured separately, on the engine's own bucket sizes: forward+backward of one rank's
micro-batch on a plain local model (no communication), AdamW on what the stage leaves each
rank (the whole model at stage 0, a 1/N shard above), and the collectives of one step: stage 0
all-reduces the gradients; stages 1 and 2 reduce-scatter them and all-gather the updated
parameters; stage 3 gathers parameters for forward and again for backward and reduce-scatters
the gradients. With communication perfectly overlapped with compute, and the optimizer step
between backward and the parameter gather (it can overlap neither), a step's floor is

    max(communication, forward+backward) + optimizer step

Each stage is then trained through ``ZeroEngine`` (AdamW, clipping at 1.0) and its median
step printed as a multiple of its floor. fp32, like the rest of the CPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import zero_strategy as zs
from zero_strategy.comm.collectives import Communicator


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                                      vocab_size=args.vocab, n_positions=args.seq))


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _chunks(numel: int, size: int) -> list[int]:
    return [min(size, numel - i) for i in range(0, numel, size)]


def measure_parts(args: argparse.Namespace, comm: Communicator) -> dict[str, float]:
    """Seconds per step of each part, on this rank's share of the model."""
    model = _model(args)
    numel = sum(p.numel() for p in model.parameters())
    world = comm.world_size
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)  # as the engine: no accumulation into old grads
        model(input_ids=ids, labels=ids).loss.backward()

    def adamw(n: int) -> Callable[[], None]:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        return opt.step

    buckets = _chunks(numel, zs.ZeroConfig().bucket_numel)
    flats = [torch.randn(-(-n // world) * world) for n in buckets]

    def all_gather() -> None:
        for flat in flats:
            comm.all_gather(flat, flat[: flat.numel() // world].clone())

    def reduce_scatter() -> None:
        for flat in flats:
            comm.reduce_scatter(torch.empty(flat.numel() // world), flat)

    def all_reduce() -> None:
        for flat in flats:
            comm.all_reduce(flat)

    r = args.repeats
    return {"fwd_bwd": _median_time(fwd_bwd, r), "adamw_full": _median_time(adamw(numel), r),
            "adamw_shard": _median_time(adamw(-(-numel // world)), r),
            "all_gather": _median_time(all_gather, r),
            "reduce_scatter": _median_time(reduce_scatter, r),
            "all_reduce": _median_time(all_reduce, r), "params": numel}


def floors(parts: dict[str, float]) -> dict[int, float]:
    ag, rs, ar, compute = (parts["all_gather"], parts["reduce_scatter"], parts["all_reduce"],
                           parts["fwd_bwd"])
    comm = {0: ar, 1: rs + ag, 2: rs + ag, 3: 2 * ag + rs}
    return {stage: max(c, compute) + (parts["adamw_full"] if stage == 0 else
                                      parts["adamw_shard"])
            for stage, c in comm.items()}


def train_stage(args: argparse.Namespace, stage: int) -> float:
    model = _model(args)
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                           zs.ZeroConfig(stage=stage))
    gen = torch.Generator().manual_seed(2 + dist.get_rank())
    times = []
    dist.barrier()
    mark = time.perf_counter()
    for i in range(args.steps + 2):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        if i == args.steps + 1:  # back to back, the last with what it left in flight
            dist.barrier()  # (bench/compare.py's train says why)
        now = time.perf_counter()
        if i >= 2:
            times.append(now - mark)
        mark = now
    engine.close()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 4), ("width", 512), ("heads", 8), ("vocab", 8192),
                          ("seq", 128), ("batch", 4), ("steps", 6), ("repeats", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    comm = Communicator()
    parts = measure_parts(args, comm)
    floor = floors(parts)
    rows = {}
    for stage in (int(s) for s in args.stages.split(",")):
        step = train_stage(args, stage)
        rows[f"zero{stage}"] = {"step_s": step, "floor_s": floor[stage],
                                "multiple": step / floor[stage]}
    if dist.get_rank() == 0:
        report = {"world_size": comm.world_size, "parts_s": parts, "stages": rows}
        print(json.dumps(report, indent=1))
        print(f"{'system':10s} {'step s':>8s} {'floor s':>8s} {'x floor':>8s}")
        for name, row in rows.items():
            print(f"{name:10s} {row['step_s']:8.3f} {row['floor_s']:8.3f} {row['multiple']:8.2f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
