"""Several optimizers over disjoint parameter sets, used as one: Muon for the hidden matrices
beside AdamW for the rest, where a framework takes a single optimizer (Lightning's automatic
optimization, an LR scheduler for every group, one ``optimizer.step()`` in a loop).

``param_groups`` is the concatenation of the parts' groups (the same dicts, so a scheduler on a
part and one on the whole change the same values); the engine numbers groups in that order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any

import torch


class CombinedOptimizer(torch.optim.Optimizer):
    """``CombinedOptimizer([muon, adamw])``: ``step``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` act on every part in order; each part keeps its own hyperparameters,
    state and schedulers. Every parameter must belong to exactly one part."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        # Optimizer.__init__ would copy groups into a list of its own; ours is a live view.
        self.optimizers = flatten(optimizers)
        check_disjoint(self.optimizers)
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._patch_step_function()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property  # type: ignore[override]
    def state(self) -> PartsState:
        """Every part's state as one mapping; a write goes to the part holding the parameter
        (Lightning moves optimizer state between devices through it)."""
        return PartsState(self.optimizers)

    def __getstate__(self) -> dict[str, Any]:
        return {"optimizers": self.optimizers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["optimizers"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return "CombinedOptimizer(" + ", ".join(type(o).__name__ for o in self.optimizers) + ")"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError("CombinedOptimizer.add_param_group: add the group to one of its parts "
                        "(combined.optimizers[i].add_param_group(...)); the combined "
                        "optimizer sees it at once")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(parts, list) or len(parts) != len(self.optimizers):
            raise ValueError(
                f"CombinedOptimizer.load_state_dict: expected {{'optimizers': [...]}} with "
                f"{len(self.optimizers)} entries (one per part, as state_dict() returns); "
                "nothing was loaded")
        for opt, part in zip(self.optimizers, parts):
            opt.load_state_dict(part)


class PartsState(MutableMapping):
    """The parts' ``state`` dicts seen as one, keyed by parameter."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def _holder(self, param: torch.Tensor) -> torch.optim.Optimizer:
        for opt in self.optimizers:
            if param in opt.state or any(p is param for g in opt.param_groups
                                         for p in g["params"]):
                return opt
        raise KeyError("not a parameter of any part of this CombinedOptimizer")

    def __getitem__(self, param: torch.Tensor) -> Any:
        for opt in self.optimizers:
            if param in opt.state:
                return opt.state[param]
        raise KeyError("no state for this parameter")

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        self._holder(param).state[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._holder(param).state[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self.optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self.optimizers)


def flatten(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The parts, a nested CombinedOptimizer unpacked, every entry checked."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    out: list[torch.optim.Optimizer] = []
    for i, opt in enumerate(optimizers):
        if isinstance(opt, CombinedOptimizer):
            out += opt.optimizers
        elif isinstance(opt, torch.optim.Optimizer):
            out.append(opt)
        else:
            raise TypeError(f"optimizers[{i}] must be a torch.optim.Optimizer, got "
                            f"{type(opt).__name__}")
    if not out:
        raise ValueError("CombinedOptimizer needs at least one optimizer")
    return out


def check_disjoint(optimizers: list[torch.optim.Optimizer]) -> None:
    """A parameter in two optimizers would be updated twice per step."""
    seen: dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in seen and seen[id(p)] != i:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is in optimizers {seen[id(p)]} "
                        f"({type(optimizers[seen[id(p)]]).__name__}) and {i} "
                        f"({type(opt).__name__}): every parameter must belong to exactly one")
                seen[id(p)] = i


def parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    return optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else [optimizer]
