"""Model trees built from parts, for the differential harness (tests/support/space.py).

A model is a JSON-able spec: a hidden width, an embedding, a list of parts applied in order to
hidden states of shape (batch, tokens, width), and a head (its own Linear or tied to the
embedding). Each part is a shape users bring: Linear, LayerNorm, Conv1d, MultiheadAttention,
a module holding direct parameters (a vector and a 0-dim temperature), a layer called twice, a
layer frozen at construction, int and bool buffers read in forward, experts of which each rank
runs only those its tokens route to, and a parameter read outside ``forward`` by the loss.
Widths and vocabularies are small primes and odd numbers, so sizes rarely divide the world.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

PARTS = ("linear", "layernorm", "conv1d", "mha", "direct", "twice", "frozen", "buffers",
         "experts", "outside")
PART_CLASSES = {"linear": "Residual", "layernorm": "LayerNorm", "conv1d": "Conv",
                "mha": "Attention", "direct": "Direct", "twice": "Twice", "frozen": "Frozen",
                "buffers": "Buffers", "experts": "Experts", "outside": "Outside"}
"""The module class each part builds (``activation_checkpointing`` names classes)."""


class Residual(nn.Module):
    def __init__(self, d: int, bias: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Conv(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d, d, kernel_size=3, padding=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.conv(h.transpose(1, 2)).transpose(1, 2))


class Attention(nn.Module):
    """nn.MultiheadAttention with biases. Its key bias (the middle third of ``in_proj_bias``)
    has a true gradient of exactly zero: softmax is invariant to adding one constant to a
    query's logits, which is all a key bias does. See ``exact_zero_grads``."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(h, h, h, need_weights=False)
        return h + out


class Direct(nn.Module):
    """Parameters held directly, of rank 1 and 0 (a learnable temperature, CLIP's
    ``logit_scale``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(d))
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale * self.temperature


class Twice(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + 0.5 * torch.tanh(self.lin(torch.tanh(self.lin(h))))


class Frozen(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.lin.requires_grad_(False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Buffers(nn.Module):
    """An int64 permutation and a bool mask as buffers (never cast, never trained)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("perm", torch.randperm(d))
        self.register_buffer("mask", torch.rand(d) > 0.3)
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.where(self.mask, h[..., self.perm], 0.0) * self.gain


class Experts(nn.Module):
    """A mixture of experts routed by token id, so a rank runs only the experts its tokens
    pick: the ranks run different modules (``unit_leaf_classes=("Experts",)`` at stage 3)."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        route = ids % len(self.experts)
        out = h.clone()
        for e, expert in enumerate(self.experts):
            picked = route == e
            if bool(picked.any()):
                out[picked] = h[picked] + torch.tanh(expert(h[picked]))
        return out


class Outside(nn.Module):
    """A weight the loss reads outside ``forward`` (a regulariser)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + 0.1 * self.lin(h)


class SpaceModel(nn.Module):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        d, vocab = spec["width"], spec["vocab"]
        self.spec = spec
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_part(p, d) for p in spec["parts"])
        self.norm = nn.LayerNorm(d)
        self.head = None if spec["tied"] else nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, ids) if isinstance(block, Experts) else block(h)
        h = self.norm(h)
        return F.linear(h, self.emb.weight) if self.head is None else self.head(h)


def _part(name: str, d: int) -> nn.Module:
    if name == "linear":
        return Residual(d, bias=True)
    if name == "layernorm":
        return nn.LayerNorm(d)
    if name == "conv1d":
        return Conv(d)
    if name == "mha":
        return Attention(d, 2 if d % 2 == 0 else 1)
    if name == "direct":
        return Direct(d)
    if name == "twice":
        return Twice(d)
    if name == "frozen":
        return Frozen(d)
    if name == "buffers":
        return Buffers(d)
    if name == "experts":
        return Experts(d, 3)
    if name == "outside":
        return Outside(d)
    raise ValueError(f"unknown part {name!r}; parts: {PARTS}")


def build(spec: dict[str, Any]) -> SpaceModel:
    torch.manual_seed(spec["seed"])
    return SpaceModel(spec)


def loss(model: nn.Module, call: Any, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of ``call(ids)`` (the engine or the model), plus a term reading the
    ``outside`` parts' weights through ``model``'s attributes after the forward."""
    logits = call(ids)
    out = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    for block in model.blocks:
        if isinstance(block, Outside):
            out = out + 1e-2 * block.lin.weight.float().pow(2).sum()
    return out


def exact_zero_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Elements whose true gradient is exactly zero, by parameter name: the attention key bias
    (see ``Attention``). Rounding noise arrives there, and optimizers that divide by a running
    gradient scale (Adam, RMSprop, Adagrad) turn noise into full lr-sized steps whose sign
    depends on summation order, so those elements are not compared with the rest."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention) and module.in_proj_bias is not None:
            d = module.embed_dim
            mask = torch.zeros(3 * d, dtype=torch.bool)
            mask[d : 2 * d] = True
            out[f"{name}.in_proj_bias"] = mask
    return out


def data(spec: dict[str, Any], seed: int, batch: int, tokens: int) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec["vocab"], (batch, tokens), generator=g)
    targets = torch.randint(0, spec["vocab"], (batch, tokens), generator=g)
    return ids, targets
