"""What the engine knows of an optimizer before it steps, checked against torch itself (in
process, no world): where each kind runs (``optim/sharded.placement``), and how many
parameter-sized state tensors each keeps (``known_states``, which sizes the memory prediction
before the first step has created any state).

The reference for the state count is the optimizer's own first step on a probe parameter:
the tensors it leaves in ``state`` with the parameter's shape.
"""

from __future__ import annotations

import pytest
import torch

from zero_strategy.optim.sharded import ELEMENTWISE, known_states, placement

# each elementwise class of torch with the options that change how many states it keeps
CASES = [(cls, {}) for cls in ELEMENTWISE] + [
    (torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adam, {"amsgrad": True}),
    (torch.optim.AdamW, {"amsgrad": True}), (torch.optim.RMSprop, {"momentum": 0.9}),
    (torch.optim.RMSprop, {"centered": True}),
    (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}),
]


def _created(cls: type[torch.optim.Optimizer], options: dict) -> int:
    p = torch.nn.Parameter(torch.ones(3, 5))
    optimizer = cls([p], lr=0.1, **options)
    p.grad = torch.full_like(p, 0.5)
    optimizer.step()
    return sum(1 for v in optimizer.state[p].values()
               if isinstance(v, torch.Tensor) and v.shape == p.shape)


@pytest.mark.parametrize(("cls", "options"), CASES,
                         ids=[c.__name__ + "".join(f"-{k}" for k in o) for c, o in CASES])
def test_states_known_before_a_step_are_those_torch_creates(cls: type, options: dict) -> None:
    p = torch.nn.Parameter(torch.ones(3, 5))
    assert known_states(cls([p], lr=0.1, **options)) == _created(cls, options)


def test_an_unknown_optimizer_is_assumed_to_keep_two_states() -> None:
    """Adam's two: an overestimate for a user's optimizer, the memory prediction errs high."""

    class Mine(torch.optim.Optimizer):
        def __init__(self, params: object) -> None:
            super().__init__(params, {"lr": 0.1})

    assert known_states(Mine([torch.nn.Parameter(torch.ones(2))])) == 2


class _KeepsStep(torch.optim.AdamW):
    """A subclass that adds nothing to the update: the same math as AdamW's."""


class _OwnStep(torch.optim.AdamW):
    """A subclass with its own step: it may read whole parameters (norms, shapes)."""

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        return super().step(closure)


def test_a_subclass_runs_on_shards_only_while_it_keeps_its_bases_step() -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    assert placement(torch.optim.AdamW(params), declared=False) == "shard"
    assert placement(_KeepsStep(params), declared=False) == "shard"
    assert placement(_OwnStep(params), declared=False) == "owner"
    # declared elementwise: a user's class runs on shards; torch's whole-parameter ones never
    assert placement(_OwnStep(params), declared=True) == "shard"
    assert placement(torch.optim.Adafactor(params), declared=True) == "owner"
