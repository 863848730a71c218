"""Tiny transformers mixture-of-experts configurations (Qwen3-MoE, Mixtral: fused 3-D expert
weights, a top-k router) and a counter of the tokens each expert receives, shared by the MoE
worlds (tests/worlds/moe_run.py, tests/worlds/lightning_moe.py). Importing it imports no
model code until a config is asked for."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
EXPERTS = 8


def config(family: str) -> Any:
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
                  bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)
    if family == "qwen3moe":
        from transformers import Qwen3MoeConfig

        # The router's load-balancing loss joins the loss (output_router_logits).
        return Qwen3MoeConfig(**common, head_dim=16, intermediate_size=64,
                              moe_intermediate_size=32, num_experts=EXPERTS,
                              decoder_sparse_step=1, norm_topk_prob=True,
                              output_router_logits=True, router_aux_loss_coef=0.05)
    from transformers import MixtralConfig

    return MixtralConfig(**common, intermediate_size=48, num_local_experts=EXPERTS)


def count_routes(model: torch.nn.Module) -> list[list[list[int]]]:
    """Per training forward, per MoE layer: tokens routed to each expert on this rank (from
    the router's top-k indices, the third output of transformers' routers)."""
    seen: list[list[list[int]]] = []
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert routers, "no router found"

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if not module.training:
            return
        if module is routers[0]:
            seen.append([])
        seen[-1].append(torch.bincount(output[2].flatten(), minlength=EXPERTS).tolist())

    for router in routers:
        router.register_forward_hook(hook)
    return seen
