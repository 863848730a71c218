"""Per-rank memory of a stage-3 step of a mixture-of-experts model whose experts are separate
modules (an ``nn.ModuleList`` chosen by a router, as custom models and transformers 4 write
them; ``core/routed.py`` gathers such a block as one unit), beside ``engine.phase_bounds()``.

The ranks read different halves of the vocabulary, so each leaves some experts without a
token: such an expert sends no gradient on that rank. The model: an embedding and a head over
8192 tokens, 6 blocks of 16 experts (top 2 of a softmax router, each expert 512 -> 1024 ->
512), width 512: 109M parameters, 414 MiB fp32, each block a 64 MiB unit. AdamW, 16 tokens
per rank (32 picks of 16 experts: about two idle per block and step), fp32, 2 processes
(gloo), 3 steps::

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python -m torch.distributed.run \\
        --standalone --nproc_per_node 2 bench/routed_memory.py [--json out.json]

Prints, per phase, the largest growth over the steps (rank 0 and 1) and the bound, with the
experts each block left idle per rank and step. The activations term is the engine's
measured saved activations of the first forward plus the logits' gradient (no formula covers
this custom model). About a minute.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from phase_memory import MIB, PHASES, Meter
from torch import nn
from torch.nn import functional as F

import zero_strategy as zs

VOCAB, WIDTH, HIDDEN, EXPERTS, BLOCKS, TOKENS, STEPS = 8192, 512, 1024, 16, 6, 16, 3


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h)))


class Block(nn.Module):
    """Top-2 of the experts by a softmax router; only experts that got tokens run."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.idle: list[list[int]] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, chosen = F.softmax(self.gate(h), dim=-1).topk(2, dim=-1)
        out = torch.zeros_like(h)
        idle = []
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, expert(h[token]) * weights[token, slot, None])
            else:
                idle.append(e)
        self.idle.append(idle)
        return h + out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    meter = Meter()
    meter.start(collect=True)
    torch.manual_seed(0)
    model = Net()
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                           zs.ZeroConfig(stage=3))
    meter.stop("load")
    g = torch.Generator().manual_seed(rank)
    half = VOCAB // 2
    for step in range(STEPS):
        ids = torch.randint(rank * half, (rank + 1) * half, (TOKENS,), generator=g)
        meter.start()
        logits = engine(ids)
        meter.stop("forward")
        meter.start()
        engine.backward(F.cross_entropy(logits, torch.roll(ids, -1)))
        meter.stop("backward")
        del logits
        meter.start()
        engine.step()
        engine.zero_grad()
        meter.stop("step")
        if step == 0:  # the first training forward's saved tensors, and the logits' gradient
            saved = engine.memory_report()["activation_bytes"] or 0
            bounds = engine.phase_bounds(activation_bytes=saved + 2 * TOKENS * VOCAB * 4,
                                         loaded_whole=True)  # built whole on every rank
    where = Path(tempfile.mkdtemp(prefix="zs-routed-")) if rank == 0 else None
    shared = [str(where)]
    dist.broadcast_object_list(shared)
    meter.start(collect=True)
    engine.save_pretrained(shared[0])
    meter.stop("save")
    dist.barrier()
    if where is not None:
        shutil.rmtree(where, ignore_errors=True)
    record = {"rank": rank, "growth": meter.growth,
              "bound": {ph: round(bounds.of(ph) / MIB, 1) for ph in PHASES},
              "terms": {k: round(v / MIB, 1) for k, v in bounds.terms.items()},
              "idle": [b.idle for b in model.blocks]}
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if rank == 0:
        for r in records:
            print(f"rank {r['rank']}: " + ", ".join(
                f"{ph} {r['growth'][ph]:.0f}/{r['bound'][ph]:.0f}" for ph in PHASES)
                + " MiB (growth/bound); idle experts per block and step: "
                + json.dumps(r["idle"]))
        print("terms (rank 0):", json.dumps(records[0]["terms"]))
        if opts.json:
            opts.json.write_text(json.dumps(records, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
