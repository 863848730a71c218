"""Small models and data for the tests, built without downloads."""

from __future__ import annotations

import os

import torch
from torch import nn

import zero_strategy as zs

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class MLP(nn.Module):
    """Odd sizes on purpose: parameter counts that do not divide by 2 or 3 exercise padding."""

    def __init__(self, d_in: int = 16, hidden: int = 33, d_out: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU())
                                    for _ in range(3))
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(self.norm(h))


class TwiceMLP(MLP):
    """Calls one block twice per forward: a module reused within a step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = h + self.blocks[0](h)
        h = h + self.blocks[1](h)
        h = h + self.blocks[0](h)  # second call of blocks[0]
        h = h + self.blocks[2](h)
        return self.out(self.norm(h))


def tiny_gpt2(seed: int = 0, n_layer: int = 2, n_embd: int = 32, vocab: int = 96) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab, n_positions=32, n_embd=n_embd, n_layer=n_layer, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def make_model(kind: str, seed: int = 0) -> nn.Module:
    if kind == "gpt2":
        return tiny_gpt2(seed)
    torch.manual_seed(seed)
    return {"mlp": MLP, "twice": TwiceMLP}[kind]()


def batch(kind: str, generator: torch.Generator, size: int = 4) -> dict[str, torch.Tensor]:
    if kind == "gpt2":
        ids = torch.randint(0, 96, (size, 12), generator=generator)
        return {"input_ids": ids, "labels": ids}
    return {"x": torch.randn(size, 16, generator=generator),
            "y": torch.randn(size, 5, generator=generator)}


def loss_of(kind: str, model_or_engine, data: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind == "gpt2":
        return model_or_engine(input_ids=data["input_ids"], labels=data["labels"]).loss
    # The loss in fp32, as transformers' losses upcast logits: torch 2.9's mse_loss backward
    # fails on a half/bf16 input beside a float target ("Found dtype Float but expected
    # Half"); the values and gradients are bit-identical to the mixed call where it works.
    return nn.functional.mse_loss(model_or_engine(data["x"]).float(), data["y"])


STAGE3 = {
    "mlp": {"unit_numel": 500, "param_persistence_threshold": 40},
    "twice": {"unit_numel": 500, "param_persistence_threshold": 40},
    "gpt2": {"unit_numel": 5000, "param_persistence_threshold": 100},
}


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        # eps=1e-6 rather than 1e-8: GPT-2's attention key bias has a gradient that is exactly
        # zero in exact arithmetic (softmax is shift-invariant), so what arrives is rounding
        # noise (~1e-13) that differs with summation order; Adam scales it by 1/eps into
        # lr-sized steps. With 1e-6 those elements stay within 1e-6 of DDP, the rest is AdamW.
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.SGD(
        [{"params": matrices, "weight_decay": 1e-3}, {"params": vectors, "lr": 0.02}],
        lr=0.05, momentum=0.9,
    )


def zero_config(kind: str, stage: int, **extra) -> zs.ZeroConfig:
    return zs.ZeroConfig(stage=stage, **(STAGE3[kind] if stage == 3 else {}), **extra)
