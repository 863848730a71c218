"""Peak RSS of `zero-strategy consolidate` on a model of a given size (default 256 MB fp32).

    python bench/measure_consolidation.py [--layers 64] [--width 1024] [--dir /tmp/zs-consolidate]

Trains one AdamW step of a stack of Linear layers with stage 3 on 2 processes, saves a
sharded checkpoint, then consolidates it in a fresh process and prints that process's peak
RSS growth next to the model size.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _save(args: argparse.Namespace) -> None:
    import zero_strategy as zs

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                      for _ in range(args.layers)])
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                           zs.ZeroConfig(stage=3))
    engine.backward(engine(torch.randn(2, args.width)).square().mean())
    engine.step()
    engine.save_checkpoint(args.dir)
    dist.destroy_process_group()


def _consolidate(src: str, out: str) -> None:
    import zero_strategy as zs

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    zs.write_consolidated(src, out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    print(f"consolidated into {out}: {Path(out).stat().st_size / 2**20:.0f} MiB written, "
          f"peak RSS growth {peak / 1024:.1f} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--dir", default="/tmp/zs-consolidate")
    p.add_argument("--consolidate", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.consolidate:
        _consolidate(*args.consolidate)
        return
    if "RANK" in os.environ:
        _save(args)
        return
    model_mib = args.layers * (args.width + 1) * args.width * 4 / 2**20
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {model_mib:.0f} MiB fp32")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", __file__, *sys.argv[1:]], check=True, env=env)
    ckpt_bytes = sum(f.stat().st_size for f in Path(args.dir).rglob("*.safetensors"))
    print(f"checkpoint: {ckpt_bytes / 2**20:.0f} MiB on disk (fp32 master + 2 Adam states)")
    subprocess.run([sys.executable, __file__, "--consolidate", args.dir,
                    str(Path(args.dir) / "consolidated.safetensors")], check=True, env=env)


if __name__ == "__main__":
    main()
