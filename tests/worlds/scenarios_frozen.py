"""Models prepared for evaluation only beside the trained one (``ZeroAccelerator.prepare_model
(model, evaluation_mode=True)``: TRL's reference and reward models), run by
tests/quick/test_frozen_models.py on 2 gloo processes.

One accelerator per scenario: a trained tiny GPT-2 with its optimizer, and a reference copy
prepared for evaluation. At stage 3 the reference is a frozen engine: what it holds, its
forward and greedy ``generate()`` against the unsharded copy; at stage 2 it stays whole.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.support.harness import scenario
from tests.support.models import tiny_gpt2
from zero_strategy.accelerate import ZeroAccelerator, ZeroPlugin
from zero_strategy.integrations.accelerate.models import ZeroFrozenModel

PROMPT = torch.tensor([[5, 9, 2, 7]])
NEW_TOKENS = 5


def _prepared(stage: int) -> tuple[ZeroAccelerator, Any, torch.nn.Module]:
    # Threshold 0 at stage 3: every parameter of the tiny model sharded (none kept whole).
    options = {"param_persistence_threshold": 0} if stage == 3 else {}
    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=stage, **options))
    policy = tiny_gpt2()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    prepared, _ = accelerator.prepare(policy, optimizer)
    reference = accelerator.prepare_model(tiny_gpt2(), evaluation_mode=True)
    return accelerator, prepared, reference


def _storage_bytes(module: torch.nn.Module) -> int:
    """What the module's own parameter tensors hold now (stage 3: placeholders only)."""
    return sum(p.untyped_storage().nbytes() for p in module.parameters())


@scenario
def frozen_reference_at_stage3() -> dict[str, Any]:
    accelerator, prepared, reference = _prepared(3)
    plain = tiny_gpt2().eval()
    engine = reference.engine
    report = engine.memory_report()
    with torch.no_grad():
        expected = plain(PROMPT).logits
        expected_tokens = plain.generate(PROMPT, max_new_tokens=NEW_TOKENS,
                                         min_new_tokens=NEW_TOKENS, do_sample=False,
                                         pad_token_id=0)
    logits = reference(PROMPT).logits  # no torch.no_grad(): the wrapper holds none anyway
    tokens = reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)
    whole = sum(p.numel() * p.element_size() for p in plain.parameters())
    result = {
        "type": type(reference).__name__,
        "trainable": sum(p.numel() for p in reference.module.parameters() if p.requires_grad),
        "training_mode": reference.module.training,
        "states": sum(len(part.inner.state) for part in engine.optimizer.parts),
        "params_bytes": report["params_bytes"], "grads_bytes": report["grads_bytes"],
        "optimizer_bytes": report["optimizer_bytes"], "whole_bytes": whole,
        "module_storage_bytes": _storage_bytes(reference.module),
        "param_tensors": len(list(reference.module.parameters())),
        "logits_max_diff": (logits - expected).abs().max().item(),
        "logits_scale": expected.abs().max().item(),
        "logits_grad": logits.requires_grad,
        "tokens_equal": torch.equal(tokens, expected_tokens),
        "again_same": accelerator.prepare_model(reference, evaluation_mode=True) is reference,
        "trained_again": accelerator.prepare_model(prepared.module) is prepared,
        "unwrapped": accelerator.unwrap_model(reference) is reference.module,
        "config_read": reference.config.n_layer == plain.config.n_layer,
        "state_dict_equal": _state_equal(accelerator.get_state_dict(reference), plain),
        "world": accelerator.num_processes,
    }
    accelerator.free_memory()
    return result


def _state_equal(state: dict[str, torch.Tensor], plain: torch.nn.Module) -> bool:
    expected = plain.state_dict()
    return state.keys() == expected.keys() and all(
        torch.equal(state[k], expected[k]) for k in state)


@scenario
def reference_below_stage3_stays_whole() -> dict[str, Any]:
    accelerator, _, reference = _prepared(2)
    result = {"frozen": isinstance(reference, ZeroFrozenModel),
              "type": type(reference).__name__,
              "storage_bytes": _storage_bytes(reference),
              "whole_bytes": sum(p.numel() * p.element_size() for p in reference.parameters())}
    accelerator.free_memory()
    return result


def _watch_placement(model: torch.nn.Module, seen: list[dict[str, Any]]) -> None:
    """Record each ``model.to(...)``: the device asked for, and whether a parameter's memory
    changed (a copy of every weight)."""
    original = model.to

    def to(*args: Any, **kwargs: Any) -> Any:
        p = next(model.parameters())
        before = p.data_ptr()
        out = original(*args, **kwargs)
        seen.append({"device": str(args[0] if args else kwargs.get("device")),
                     "copied": next(model.parameters()).data_ptr() != before})
        return out

    model.to = to  # type: ignore[method-assign]


@scenario
def placement_copies_nothing() -> dict[str, Any]:
    """A model loaded whole (not on meta) placed on the accelerator's device before its
    engine is built, the trained one and a reference: Accelerate calls the CPU "cpu:0",
    which CPU tensors never report, so placing there must ask for plain "cpu"."""
    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=3))
    seen: list[dict[str, Any]] = []
    policy, reference = tiny_gpt2(), tiny_gpt2()
    _watch_placement(policy, seen)
    _watch_placement(reference, seen)
    accelerator.prepare(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3))
    accelerator.prepare_model(reference, evaluation_mode=True)
    asked = str(accelerator.device)
    accelerator.free_memory()
    return {"placed": seen, "accelerator_device": asked}
