"""Sharded init through ``ZeroEngine`` against eager construction, for
tests/quick/test_sharded_init.py (run by tests/support/harness.py; one rank is enough: the
question is what each rank's generator produces)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import zero_strategy as zs
from tests.support.harness import scenario
from tests.support.init_models import Net, torch_attention_net, torch_net
from zero_strategy.core.materialize import default_init, meta_init

# Small units and no persistent parameters: every module becomes its own unit, materialised
# children first, i.e. in another order than construction.
CONFIG = zs.ZeroConfig(stage=3, unit_numel=32, param_persistence_threshold=0)


def against_eager(build: Callable[[], nn.Module], how: str,
                  config: zs.ZeroConfig = CONFIG) -> dict[str, Any]:
    torch.manual_seed(0)
    eager = build()
    expected = {k: v.detach().clone() for k, v in eager.state_dict().items()}
    after = torch.get_rng_state()
    next_draws = torch.rand(4)

    names: dict[int, str] = {}
    calls: list[str] = []

    def init(module: nn.Module) -> None:  # the default, recording which module and when
        calls.append(names[id(module)])
        default_init(module)

    torch.manual_seed(0)
    context = meta_init("cpu", init) if how == "meta_init" else torch.device("meta")
    with context:
        model = build()
        names.update({id(m): n or "<root>" for n, m in model.named_modules()})
    engine = zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config,
                           param_init_fn=init)
    rng_equal = torch.equal(torch.get_rng_state(), after)
    draws_equal = torch.equal(torch.rand(4), next_draws)
    full = engine.full_state_dict()
    units = len(engine.units)
    engine.close()
    half = len(calls) // 2  # each module's init: replayed in construction order, then for real
    return {
        "keys": sorted(expected),
        "differ": sorted(k for k in expected if not torch.equal(full[k], expected[k])),
        "rng_equal": rng_equal, "draws_equal": draws_equal,
        "replay_order": calls[:half], "materialize_order": calls[half:],
        "units": units,
    }


@scenario
def engine_meta_init() -> dict[str, Any]:
    return against_eager(Net, "meta_init")


@scenario
def engine_plain_meta_torch_modules() -> dict[str, Any]:
    return against_eager(torch_net, "plain")


@scenario
def engine_plain_meta_custom_modules() -> dict[str, Any]:
    return against_eager(Net, "plain")


@scenario
def engine_meta_init_default_config() -> dict[str, Any]:
    """Default units: small parameters (biases, norms) are kept whole in buckets built after
    the units, so their modules are materialised last."""
    return against_eager(Net, "meta_init", zs.ZeroConfig(stage=3))


@scenario
def engine_meta_init_torch_attention() -> dict[str, Any]:
    """MultiheadAttention / encoder and decoder layers: every module its own unit, so each
    ``out_proj`` is materialised and sharded before its attention zeroes its bias."""
    return against_eager(torch_attention_net, "meta_init")


@scenario
def engine_plain_meta_torch_attention() -> dict[str, Any]:
    return against_eager(torch_attention_net, "plain")
