"""Train a small GPT-2 with ZeRO on CPU processes, on text that ships with Python.

    python recipes/train_gpt.py                      # 2 processes, stage 3, 200 steps
    python recipes/train_gpt.py --stage 2 --nproc 3 --steps 50

Started without torchrun, the script launches itself under torch.distributed.run with
--nproc processes (gloo). Data: the English help topics in the standard library's
``pydoc_data``, as bytes (vocabulary 256), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--nproc", type=int, default=2, help="processes to launch (without torchrun)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=20)
    return p.parse_args(argv)


def corpus() -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.width,
                        n_layer=args.layers, n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def train(args: argparse.Namespace) -> None:
    import zero_strategy as zs

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = corpus()
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    config = zs.ZeroConfig(stage=args.stage, **({"unit_numel": 100_000} if args.stage == 3 else {}))
    engine = zs.ZeroEngine(model, optimizer, config)
    if rank == 0:
        print(engine.plan.describe())
        print(f"{engine.num_params / 1e6:.2f}M parameters, {len(data) / 1e6:.2f}M bytes of text")
    gen = torch.Generator().manual_seed(rank)
    t0, tokens, first = time.perf_counter(), 0, None
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        ids = torch.stack([data[s : s + args.seq] for s in starts.tolist()])
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        tokens += ids.numel() * world
        first = first if first is not None else loss.item()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            rate = tokens / (time.perf_counter() - t0)
            print(f"step {step:4d}  loss {loss.item():.3f}  {rate:,.0f} tokens/s", flush=True)
    report = engine.memory_report()
    comm = engine.comm_bytes()
    for r in range(world):
        if r == rank:
            mib = 2.0**20
            print(f"rank {rank}: model states {report['total_bytes'] / mib:.1f} MiB "
                  f"(ZeRO formula {report['predicted_total_bytes'] / mib:.1f} MiB; params "
                  f"{report['params_bytes'] / mib:.1f}, grads {report['grads_bytes'] / mib:.1f}, "
                  f"optimizer {report['optimizer_bytes'] / mib:.1f}); "
                  f"sent {comm['total'] / args.steps / mib:.1f} MiB/step", flush=True)
        dist.barrier()
    if rank == 0:
        print(f"loss {first:.3f} -> {loss.item():.3f}")
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        train(args)
        return
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(torchrun(["--standalone", "--nproc_per_node", str(args.nproc), __file__,
                       *sys.argv[1:]]))


if __name__ == "__main__":
    main()
