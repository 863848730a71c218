"""Muon beside AdamW in the shared anchor benchmark (``../shared/bench/anchors.py``).

Runs one anchors.py training run with every ``torch.optim.AdamW`` the benchmark builds replaced
by ``CombinedOptimizer([Muon(hidden Conv1D weights, lr 0.02), AdamW(the rest)])``: under
``ddp`` every rank then orthogonalises every matrix (the redundant approach), under ``zs_*``
each matrix is updated once, on its owner. Newton-Schulz runs in fp32 for every system with
``--ns-fp32`` (bf16 matmuls are ~80x slower than fp32 on a CPU without bf16 units)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 recipes/muon_bench.py \\
        --anchors ../shared/bench/anchors.py --optim muon --ns-fp32 -- \\
        --system zs_zero1 --regime throughput --precision fp32 --out muon.json
    python ../shared/bench/anchors.py --report muon.json
"""

from __future__ import annotations

import argparse
import runpy
import sys
from typing import Any

import torch
from transformers.pytorch_utils import Conv1D

import zero_strategy as zs
from recipes.muon_fp32 import use_fp32_newton_schulz

_CONV1D: list[Conv1D] = []
_ADAMW = torch.optim.AdamW


def _record_conv1d() -> None:
    """GPT-2's hidden matrices are its Conv1D weights: remember every one built."""
    original = Conv1D.__init__

    def init(self: Conv1D, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _CONV1D.append(self)

    Conv1D.__init__ = init  # type: ignore[method-assign]


def muon_and_adamw(params: Any, **adamw: Any) -> torch.optim.Optimizer:
    params = list(params)
    hidden = {id(m.weight) for m in _CONV1D}
    matrices = [p for p in params if id(p) in hidden]
    rest = [p for p in params if id(p) not in hidden]
    muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=adamw.get("weight_decay", 0.0))
    return zs.CombinedOptimizer([muon, _ADAMW(rest, **adamw)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--anchors", required=True, help="path of shared/bench/anchors.py")
    parser.add_argument("--optim", choices=("adamw", "muon"), default="muon")
    parser.add_argument("--ns-fp32", action="store_true",
                        help="Newton-Schulz in fp32 (every system alike)")
    args, rest = parser.parse_known_args()
    if args.optim == "muon":
        _record_conv1d()
        torch.optim.AdamW = muon_and_adamw  # type: ignore[misc,assignment]
    if args.ns_fp32:
        use_fp32_newton_schulz()
    sys.argv = [args.anchors, *[a for a in rest if a != "--"]]
    runpy.run_path(args.anchors, run_name="__main__")


if __name__ == "__main__":
    main()
