"""Mixture-of-experts models whose experts are separate modules (an ``nn.ModuleList`` chosen
by a router, as custom and older models write them), and a seeded generator of routed and
non-routed structures, for tests/quick/test_routed_blocks.py and its world
(tests/worlds/scenarios_routed.py). Importing it registers no scenario."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

D = 8
VOCAB = 16
EXPERTS = 4


class Expert(nn.Module):
    def __init__(self, d: int = D, hidden: int = 2 * D) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h)))


class RoutedMoE(nn.Module):
    """Top-2 of ``n`` experts by a softmax router (a ``Linear(d, n)``, as Mixtral's
    ``MixtralSparseMoeBlock`` before transformers 5); only experts that received tokens run,
    so an expert without tokens on a rank has no gradient there."""

    def __init__(self, n: int = EXPERTS, d: int = D) -> None:
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(n))
        self.routed: list[list[int]] = []
        """Tokens each expert received, per forward (what the tests read)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, chosen = F.softmax(self.gate(h), dim=-1).topk(2, dim=-1)
        out = torch.zeros_like(h)
        counts = []
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            counts.append(int(token.numel()))
            if token.numel():
                out = out.index_add(0, token, expert(h[token]) * weights[token, slot, None])
        self.routed.append(counts)
        return h + out


class RoutedNet(nn.Module):
    """Embedding, two routed blocks, a head; tokens are flattened to rows."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.moe1 = RoutedMoE()
        self.moe2 = RoutedMoE()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe2(self.moe1(self.emb(ids).flatten(0, 1))))


class TokenRouted(nn.Module):
    """Experts chosen by a rule in code (token id modulo n), with no router parameter: nothing
    in the structure says the block is routed, so it is not recognised."""

    def __init__(self, n: int = EXPERTS) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(n))

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = h.clone()
        for e, expert in enumerate(self.experts):
            picked = ids % len(self.experts) == e
            if bool(picked.any()):
                out[picked] = h[picked] + torch.tanh(expert(h[picked]))
        return out


class TokenRoutedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.moe = TokenRouted()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.flatten()
        return self.head(self.moe(self.emb(flat), flat))


def rank_batch(gen: torch.Generator, rank: int, rows: int = 2, seq: int = 3
               ) -> dict[str, torch.Tensor]:
    """Tokens from the rank's own half of the vocabulary (so ranks route differently), and
    next-token targets."""
    half = VOCAB // 2
    ids = torch.randint(rank * half, (rank + 1) * half, (rows, seq), generator=gen)
    return {"ids": ids, "y": torch.randint(0, VOCAB, (rows * seq,), generator=gen)}


# ------------------------------------------------------------- generated structures
class _Router(nn.Module):
    """A router that is not a Linear: its own [n, d] parameter (DeepSeek's gate)."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, d))


class _Block(nn.Module):
    def __init__(self, children: dict[str, nn.Module], own: dict[str, Any] | None = None
                 ) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        for name, shape in (own or {}).items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))


def _experts(rng: random.Random, n: int, d: int, container: str) -> nn.Module:
    hidden = rng.choice([d + 1, 2 * d, 3 * d])
    entries = [Expert(d, hidden) for _ in range(n)]
    if container == "dict":
        return nn.ModuleDict({f"e{i}": e for i, e in enumerate(entries)})
    return nn.ModuleList(entries)


def routed_structure(seed: int) -> nn.Module:
    """A block with a list (or dict) of alike experts and a router in one of the forms seen
    in models: a Linear(d, n) child, a raw [d, n] or [n, d] parameter of the block, or a
    child module holding an [n, d] weight; sometimes a shared expert and a 1-output shared
    gate beside them."""
    rng = random.Random(seed)
    n, d = rng.randint(2, 9), rng.choice([6, 8, 12])
    if n == d:
        d += 2
    experts = _experts(rng, n, d, rng.choice(["list", "dict"]))
    form = rng.choice(["linear", "param_nd", "param_dn", "child"])
    children: dict[str, nn.Module] = {"experts": experts}
    own = {}
    if form == "linear":
        children["gate"] = nn.Linear(d, n, bias=rng.random() < 0.5)
    elif form == "child":
        children["gate"] = _Router(n, d)
    else:
        own["router"] = (n, d) if form == "param_nd" else (d, n)
    if rng.random() < 0.5:
        children["shared_expert"] = Expert(d, 2 * d)
        children["shared_gate"] = nn.Linear(d, 1, bias=False)
    return _Block(children, own)


def dense_structure(seed: int) -> nn.Module:
    """Lists of modules that are not routed: a stack of alike layers beside an embedding and
    a position table as long as the stack, a norm, a head; a list of different modules; a
    list of one module; alike experts with no router (chosen in code); a router-like Linear
    whose width matches neither the experts nor their count."""
    rng = random.Random(seed)
    n, d = rng.randint(2, 6), rng.choice([6, 8, 12])
    kind = rng.choice(["stack", "mixed", "single", "no_router", "other_width"])
    if kind == "stack":
        return _Block({"emb": nn.Embedding(50, d), "pos": nn.Embedding(n, d),
                       "layers": nn.ModuleList(Expert(d, 2 * d) for _ in range(n)),
                       "norm": nn.LayerNorm(d), "head": nn.Linear(d, 50)})
    if kind == "mixed":
        return _Block({"parts": nn.ModuleList([nn.Linear(d, d), nn.LayerNorm(d), Expert(d)]),
                       "gate": nn.Linear(d, 3)})
    if kind == "single":
        return _Block({"experts": nn.ModuleList([Expert(d)]), "gate": nn.Linear(d, 1)})
    if kind == "no_router":
        return _Block({"experts": nn.ModuleList(Expert(d) for _ in range(n))})
    return _Block({"experts": nn.ModuleList(Expert(d, 2 * d) for _ in range(n)),
                   "gate": nn.Linear(d + 100, n + 100)})
