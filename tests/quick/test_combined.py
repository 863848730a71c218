"""zs.CombinedOptimizer on its own (no process group): several optimizers used as one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zero_strategy as zs


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    muon = torch.optim.Muon([model[0].weight, model[2].weight], lr=0.02)
    adamw = torch.optim.AdamW([model[0].bias, model[2].bias], lr=0.01)
    return model, muon, adamw


def _train(model: nn.Module, step: object, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(5, 4, generator=gen)).pow(2).mean().backward()
        step()  # type: ignore[operator]
        model.zero_grad(set_to_none=True)


def test_steps_every_part_as_the_parts_would() -> None:
    model, muon, adamw = _setup()
    twin = copy.deepcopy(model)
    twin_opts = [torch.optim.Muon([twin[0].weight, twin[2].weight], lr=0.02),
                 torch.optim.AdamW([twin[0].bias, twin[2].bias], lr=0.01)]
    combined = zs.CombinedOptimizer([muon, adamw])
    _train(model, combined.step)
    _train(twin, lambda: [o.step() for o in twin_opts])
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert combined.param_groups == muon.param_groups + adamw.param_groups


def test_state_is_one_view_whose_writes_reach_the_part() -> None:
    model, muon, adamw = _setup()
    combined = zs.CombinedOptimizer([muon, adamw])
    _train(model, combined.step, steps=1)
    assert len(combined.state) == 4
    bias = model[0].bias
    combined.state[bias] = {k: v.clone() + 1 if v.dim() else v for k, v in
                            combined.state[bias].items()}
    assert adamw.state[bias] is combined.state[bias], "the write went to AdamW's state"
    with pytest.raises(KeyError):
        combined.state[torch.zeros(1)] = {}


def test_scheduler_over_the_whole_and_on_a_part() -> None:
    _, muon, adamw = _setup()
    combined = zs.CombinedOptimizer([muon, adamw])
    torch.optim.lr_scheduler.LambdaLR(combined, lambda k: 0.5)
    assert [g["lr"] for g in combined.param_groups] == [0.01, 0.005]
    torch.optim.lr_scheduler.LambdaLR(muon, lambda k: 0.1)
    assert muon.param_groups[0]["lr"] == pytest.approx(0.002)  # initial_lr 0.02, kept
    assert combined.param_groups[0] is muon.param_groups[0], "the same group dicts"


def test_state_dict_round_trip_and_bad_input() -> None:
    model, muon, adamw = _setup()
    combined = zs.CombinedOptimizer([muon, adamw])
    _train(model, combined.step, steps=2)
    saved = combined.state_dict()
    assert len(saved["optimizers"]) == 2
    _, muon2, adamw2 = _setup()
    fresh = zs.CombinedOptimizer([muon2, adamw2])
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.state_dict()["optimizers"][0]["state"][0]["momentum_buffer"],
                       saved["optimizers"][0]["state"][0]["momentum_buffer"])
    with pytest.raises(ValueError, match="with 2 entries"):
        fresh.load_state_dict({"optimizers": [saved["optimizers"][0]]})


def test_refusals() -> None:
    model, muon, adamw = _setup()
    both = torch.optim.SGD([model[0].weight], lr=0.1)
    with pytest.raises(ValueError, match=r"is in optimizers 0 \(Muon\) and 2 \(SGD\)"):
        zs.CombinedOptimizer([muon, adamw, both])
    with pytest.raises(TypeError, match=r"optimizers\[1\] must be a torch.optim.Optimizer"):
        zs.CombinedOptimizer([muon, "adamw"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="add the group to one of its parts"):
        zs.CombinedOptimizer([muon, adamw]).add_param_group({"params": []})
    nested = zs.CombinedOptimizer([zs.CombinedOptimizer([muon]), adamw])
    assert nested.optimizers == [muon, adamw]
