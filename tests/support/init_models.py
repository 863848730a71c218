"""Models for the sharded-init tests (tests/quick/test_sharded_init.py): every way a module can
order its parameters' creation and initialisation against its children's."""

from __future__ import annotations

import torch
from torch import nn


class Gated(nn.Module):
    """Creates its own parameter after its children, drawn as it is created."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.randn(d))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * torch.sigmoid(self.gate)


class Late(nn.Module):
    """Registers its parameter before its children and initialises it after them (the
    nn.MultiheadAttention pattern)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(d))
        self.inner = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


class Early(nn.Module):
    """Creates and initialises its parameter before its children, through ``.data``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.empty(d))
        self.reset_parameters()
        self.inner = nn.Linear(d, d)

    def reset_parameters(self) -> None:
        self.shift.data.uniform_(-0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x + self.shift)


class Net(nn.Module):
    """Embedding, custom blocks with nested Linear / LayerNorm, dropout (draws from the global
    generator while training) and an output head tied to the embedding."""

    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Gated(d), Late(d), Early(d)])
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(d, vocab)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.drop(self.norm(h)))


def torch_net(vocab: int = 40, d: int = 16) -> nn.Module:
    """Only torch.nn modules, nested: construction order is ``modules()`` order."""
    return nn.Sequential(
        nn.Embedding(vocab, d),
        nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d)), nn.Linear(d, d)]),
        nn.Linear(d, vocab),
    )


class AttentionNet(nn.Module):
    """Embedding, one nn.TransformerEncoderLayer (MultiheadAttention initialises after its
    ``out_proj`` and zeroes that child's bias; dropout draws while training), a head."""

    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=32, dropout=0.1,
                                                batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(ids)))


def torch_attention_net(d: int = 16) -> nn.Module:
    """torch's layers that initialise through ``_reset_parameters``: attention with separate
    q/k/v projections and key/value biases, an encoder and a decoder layer."""
    return nn.ModuleDict({
        "attn": nn.MultiheadAttention(d, 2, add_bias_kv=True, kdim=8, vdim=12),
        "encoder": nn.TransformerEncoderLayer(d, 2, dim_feedforward=32),
        "decoder": nn.TransformerDecoderLayer(d, 2, dim_feedforward=32),
        "head": nn.Linear(d, 4),
    })


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def token_batches(rank: int, n: int, vocab: int = 40) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, vocab, (4, 9), generator=gen) for _ in range(n)]
