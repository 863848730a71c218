"""Model code as users write it, shared by tests/worlds/scenarios_model_code.py and
tests/worlds/scenarios_optimizer.py: a small network with the patterns those scenarios exercise, its
data and losses. Importing it registers no scenario."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

D = 12
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class PosEmb(nn.Module):
    """A module whose forward returns its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(D) * 0.1)

    def forward(self) -> torch.Tensor:
        return self.pos


class Net(nn.Module):
    """Embedding, blocks, a position parameter returned by a submodule, a parent that reads a
    child's weight itself (``self.mix.weight``), and an ``encode`` method besides forward."""

    def __init__(self, vocab: int = 17) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.pos = PosEmb()
        self.blk = Block()
        self.blk2 = Block()
        self.mix = nn.Linear(D, D, bias=False)
        self.head = nn.Linear(D, 3)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).mean(1) + self.pos()
        h = self.blk2(self.blk(h))
        return h + 0.5 * torch.tanh(F.linear(h, self.mix.weight))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(ids))


class HiddenNet(Net):
    """Returns hidden states: the caller applies the (tied) head."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encode(ids)


def batches(gen: torch.Generator, world: int) -> list[dict[str, torch.Tensor]]:
    return [{"ids": torch.randint(0, 17, (4, 5), generator=gen),
             "y": torch.randint(0, 3, (4,), generator=gen)} for _ in range(world)]


# Each loss gets (call, module, batch): ``call`` runs the forward (the engine, or the reference
# model itself), ``module`` is the model object user code reaches attributes through.
Loss = Callable[[Any, nn.Module, dict], torch.Tensor]


def loss_plain(call: Any, module: nn.Module, b: dict) -> torch.Tensor:
    return F.cross_entropy(call(b["ids"]), b["y"])


def loss_l2(call: Any, module: nn.Module, b: dict) -> torch.Tensor:
    """A regulariser that reads a parameter after forward."""
    return loss_plain(call, module, b) + 0.05 * module.blk.lin.weight.pow(2).sum()


def loss_tied_head(call: Any, module: nn.Module, b: dict) -> torch.Tensor:
    """A tied output head applied by the caller: hidden states @ embedding matrix^T."""
    logits = call(b["ids"]) @ module.emb.weight.T
    return F.cross_entropy(logits, b["ids"][:, 0])


def loss_encode(call: Any, module: nn.Module, b: dict) -> torch.Tensor:
    """The model driven through a method other than forward."""
    return F.cross_entropy(module.head(module.encode(b["ids"])), b["y"])


LOSSES: dict[str, Loss] = {
    "plain": loss_plain, "l2": loss_l2, "tied_head": loss_tied_head, "encode": loss_encode,
}


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k].double() - b[k].double()).abs().max()
                / b[k].double().abs().max().clamp_min(1e-12)).item() for k in b)


