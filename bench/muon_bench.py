"""Muon beside AdamW on the work of ``bench/compare.py``.

Runs one compare.py training run with its AdamW replaced by
``CombinedOptimizer([Muon(hidden Conv1D weights, lr 0.02), AdamW(the rest)])``: under ``ddp``
every rank then orthogonalises every matrix (the redundant approach), under ``zs_*`` each
matrix is updated once, on its owner (``fsdp2_*`` also take it; ``torch_zero1`` and ``ds_*``
build their own optimizer and are refused). Newton-Schulz runs in fp32 for every system with
``--ns-fp32`` (bf16 matmuls are ~80x slower than fp32 on a CPU without bf16 units)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/muon_bench.py \\
        --optim muon --ns-fp32 -- \\
        --system zs_zero1 --regime throughput --precision fp32 --out muon.json
    python bench/compare.py --combine muon.json --out page.json --command "..."

The record names the optimizer (``optimizer``: ``muon+adamw`` or ``adamw``) and whether
Newton-Schulz ran in fp32 (``ns_fp32``).
"""

from __future__ import annotations

import argparse
from typing import Any

import compare
import torch
from muon_fp32 import use_fp32_newton_schulz
from transformers.pytorch_utils import Conv1D

import zero_strategy as zs


def muon_and_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Muon on GPT-2's hidden matrices (its Conv1D weights), AdamW on everything else."""
    hidden = {id(m.weight) for m in model.modules() if isinstance(m, Conv1D)}
    params = list(model.parameters())
    matrices = [p for p in params if id(p) in hidden]
    rest = [p for p in params if id(p) not in hidden]
    muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=compare.ADAMW["weight_decay"])
    return zs.CombinedOptimizer([muon, torch.optim.AdamW(rest, **compare.ADAMW)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optim", choices=("adamw", "muon"), default="muon")
    parser.add_argument("--ns-fp32", action="store_true",
                        help="Newton-Schulz in fp32 (every system alike)")
    args, rest = parser.parse_known_args()
    if args.ns_fp32:
        use_fp32_newton_schulz()
    extra: dict[str, Any] = {"optimizer": "muon+adamw" if args.optim == "muon" else "adamw",
                             "ns_fp32": args.ns_fp32}
    optimizer = muon_and_adamw if args.optim == "muon" else None
    compare.main([a for a in rest if a != "--"],
                 compare.Variant(optimizer=optimizer, extra=extra))


if __name__ == "__main__":
    main()
