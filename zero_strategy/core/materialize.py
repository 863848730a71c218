"""Sharded initialisation: a model built on the meta device is materialised module by module,
just before the unit holding its parameters is flattened and sharded, so no rank ever holds
the whole model (the largest unit plus the shards built so far is the peak).

Parameters keep their identity (``torch.utils.swap_tensors`` replaces what the
``nn.Parameter`` object holds, not the object), so tied weights stay tied and an optimizer
built on the meta parameters stays valid.

Same values as eager construction. Eager construction draws every module's initial values
from the global generator in construction order; stage-3 units are materialised in another
order (children before parents), and building on meta draws nothing. So each module's
initialisation is first replayed on throw-away tensors in construction order, one module at a
time, remembering the generator state it starts from; the generator is left where eager
construction would have left it. When its unit is materialised, the module is initialised
from its remembered state and the generator is put back. ``meta_init`` (the strategies'
init contexts) records the true construction order and replays when the model is complete; a
model put on meta any other way is replayed when the engine is built, in ``modules()`` order.
README "Building large models: sharded init" states when the values equal eager construction.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from .devices import canonical_device

InitFn = Callable[[nn.Module], None]
RngState = tuple[torch.Tensor, torch.Tensor | None]
"""The CPU generator's state and, on CUDA, the device generator's (init may draw from both)."""

# Initialisers that draw random numbers, by name: torch.nn.init's functions (they reach a
# TorchFunctionMode whole, their tensor passed by keyword) and Tensor's in-place samplers.
_RANDOM_INITS = frozenset({
    "uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
    "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_", "bernoulli_", "random_",
    "exponential_", "cauchy_", "log_normal_", "geometric_",
})


def default_init(module: nn.Module) -> None:
    """``module.reset_parameters()``; modules without one cannot be initialised implicitly."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"{type(module).__name__} has parameters on the meta device and no "
            "reset_parameters(): pass param_init_fn= to ZeroEngine (for a transformers model, "
            "param_init_fn=model._init_weights) so its values are defined"
        )
    reset()


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(model, recurse=True))


def _tensors(module: nn.Module, recurse: bool) -> Iterable[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from (b for b in module.buffers(recurse=recurse) if b is not None)


def _owns_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module, recurse=False))


# ---------------------------------------------------------------------- generator state
def rng_state(device: torch.device) -> RngState:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(device: torch.device, state: RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _same(a: RngState, b: RngState) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None or b[1] is None or torch.equal(a[1], b[1]))


@contextmanager
def _rng_at(device: torch.device, state: RngState) -> Iterator[None]:
    """Run the block from ``state``, then put the generators back: materialising is invisible
    to the generator (it already stands where eager construction left it)."""
    saved = rng_state(device)
    set_rng_state(device, state)
    try:
        yield
    finally:
        set_rng_state(device, saved)


# ---------------------------------------------------------------------- replaying init
@contextmanager
def _scratch(module: nn.Module, device: torch.device, params: Iterable[str],
             buffers: Iterable[str] = ()) -> Iterator[None]:
    """Fresh throw-away tensors under these names while the block runs (init writes them and
    draws exactly what it would for the real ones); the module's own come back afterwards."""
    saved_p = {n: module._parameters[n] for n in params}
    saved_b = {n: module._buffers[n] for n in buffers}
    try:
        for n, p in saved_p.items():
            assert p is not None
            module._parameters[n] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        for n, b in saved_b.items():
            assert b is not None
            module._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device=device)
        yield
    finally:
        module._parameters.update(saved_p)
        module._buffers.update(saved_b)


def _advance(modules: Iterable[nn.Module], device: torch.device,
             init_fn: InitFn) -> dict[int, RngState]:
    """Run each module's init on throw-away tensors, in the given (construction) order, one
    module at a time: the generators move exactly as eager construction moved them. Returns
    the state each module's init started from (a CPU state is 5 KB; repeats are shared)."""
    starts: dict[int, RngState] = {}
    last: RngState | None = None
    elsewhere = _WritesElsewhere()
    with torch.no_grad(), elsewhere:
        for module in modules:
            state = rng_state(device)
            if last is not None and _same(state, last):
                state = last
            starts[id(module)] = last = state
            params = [n for n, p in module._parameters.items() if p is not None]
            buffers = [n for n, b in module._buffers.items() if b is not None]
            with _scratch(module, device, params, buffers):
                elsewhere.module = module
                init_fn(module)
    if elsewhere.writer is not None:
        warn_inexact(f"the init of a {elsewhere.writer} writes to another module's tensors "
                     "(e.g. a parent setting a child's bias), which a per-module "
                     "initialisation cannot reproduce")
    return starts


class _WritesElsewhere(TorchFunctionMode):
    """While a module's init is replayed every tensor of that module is real scratch, so an
    in-place write to a meta tensor is a write to another module's tensor: whether it lands
    depends on which of the two is materialised first, so it is reported."""

    def __init__(self) -> None:
        super().__init__()
        self.module: nn.Module | None = None
        self.writer: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))
        if in_place and self.writer is None:
            target = _first_tensor(args, kwargs)
            if target is not None and target.is_meta:
                self.writer = type(self.module).__name__
        return func(*args, **kwargs)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def warn_inexact(reason: str) -> None:
    warnings.warn(f"sharded init: {reason}; the initial weights will differ from eager "
                  "construction under the same seed (README: 'Building large models: sharded "
                  "init')", stacklevel=2)


# ---------------------------------------------------------------------- construction order
@dataclass
class _Record:
    """What ``meta_init`` learnt about one module: where its init starts on ``device``'s
    generators, and the parameters it created (their values are its init's to set)."""

    device: torch.device
    start: RngState
    created: list[torch.Tensor]


# Filled when a meta_init block ends, consumed by the Materializer. Weak keys: a discarded
# model takes its records with it. (Parameters are never weakly referenced: swap_tensors
# refuses tensors with weak references.)
_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_ACTIVE: list[_ConstructionOrder] = []


class _ConstructionOrder(TorchFunctionMode):
    """Watches a model being built on meta: which module registers each tensor first, and when
    a random initialiser first writes to each module's parameters. That is the order in which
    eager construction draws: a module may register its parameters before its children and
    initialise them after (nn.MultiheadAttention), or create them after its children."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = itertools.count()
        self.modules: list[nn.Module] = []   # held until the block ends, even if discarded
        self.registered: dict[int, int] = {}  # id(module) -> tick of its first registration
        self.drawn: dict[int, int] = {}       # id(module) -> tick of its first random draw
        self.draws: list[int] = []            # id(module) of each draw, repeats collapsed
        # id -> (tensor, module): tensors held so their ids stay theirs until the block ends.
        self.creator: dict[int, tuple[torch.Tensor, nn.Module]] = {}
        self.aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # param.data -> param

    def on_register(self, module: nn.Module, name: str, tensor: Any) -> None:
        if tensor is None or not tensor.is_meta:
            return
        tick = next(self.clock)
        if id(module) not in self.registered:
            self.registered[id(module)] = tick
            self.modules.append(module)
        self.creator.setdefault(id(tensor), (tensor, module))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch.Tensor.data:  # `p.data.normal_()` idiom
            target = self._owner_of(args[0])
            if target is not None:
                self.aliases[id(out)] = (out, target[0])
        elif getattr(func, "__name__", "") in _RANDOM_INITS:
            target = self._owner_of(_first_tensor(args, kwargs))
            if target is not None:
                tick, key = next(self.clock), id(target[1])
                self.drawn.setdefault(key, tick)
                if not self.draws or self.draws[-1] != key:
                    self.draws.append(key)
        return out

    def _owner_of(self, tensor: Any) -> tuple[torch.Tensor, nn.Module] | None:
        alias = self.aliases.get(id(tensor))
        if alias is not None and alias[0] is tensor:
            tensor = alias[1]
        entry = self.creator.get(id(tensor))
        return entry if entry is not None and entry[0] is tensor else None

    def in_order(self) -> list[nn.Module]:
        """Modules still holding meta tensors, by when their init drew in eager construction
        (their first random draw; for a module whose draws were not seen, e.g. parameters
        made by ``torch.randn`` before registering, its first registration)."""
        pending = [m for m in self.modules if _owns_meta(m)]
        return sorted(pending, key=lambda m: self.drawn.get(id(m), self.registered[id(m)]))

    def reinitialised(self) -> nn.Module | None:
        """A module whose parameters were drawn again after another module's draws (a parent
        re-initialising its children, as nn.Transformer does): one replay per module cannot
        reproduce that."""
        seen: set[int] = set()
        for key in self.draws:
            if key in seen:
                return next(m for m in self.modules if id(m) == key)
            seen.add(key)
        return None


@contextmanager
def meta_init(device: torch.device | str = "cpu",
              init_fn: InitFn | None = None) -> Iterator[None]:
    """Build models on the meta device as if they were built eagerly on ``device``, as far as
    the random number generator goes.

    While the block runs, tensors are created on meta and the construction order is recorded.
    When it ends, each new module's ``init_fn`` (default ``reset_parameters()``) runs once on
    throw-away tensors in that order, one module at a time, so the generators end where eager
    construction would have left them and the code after the block draws the same numbers as
    under DDP. The engine later initialises each module from the state its replay started
    from. Pass the ``device`` and ``param_init_fn`` the engine will get.
    """
    if _ACTIVE:  # nested (trainer.init_module() inside configure_model): the outer one records
        with torch.device("meta"):
            yield
        return
    order = _ConstructionOrder()
    hooks = [register_module_parameter_registration_hook(order.on_register),
             register_module_buffer_registration_hook(order.on_register)]
    _ACTIVE.append(order)
    try:
        with torch.device("meta"), order:
            yield
    finally:
        _ACTIVE.pop()
        for hook in hooks:
            hook.remove()
    _settle(order, canonical_device(device), init_fn or default_init)


def _settle(order: _ConstructionOrder, device: torch.device, init_fn: InitFn) -> None:
    modules = order.in_order()
    again = order.reinitialised()
    if again is not None:
        warn_inexact(f"parameters of a {type(again).__name__} were randomly initialised "
                     "again after other modules' (e.g. a parent re-initialising its children, "
                     "as nn.Transformer does); the engine replays each module's init once")
    starts = _advance(modules, device, init_fn)
    created: dict[int, list[torch.Tensor]] = {}
    for tensor, module in order.creator.values():
        created.setdefault(id(module), []).append(tensor)
    for module in modules:
        _RECORDS[module] = _Record(device, starts[id(module)], created.get(id(module), []))


def _creators(owners: dict[int, list[nn.Module]],
              records: dict[int, _Record]) -> dict[int, nn.Module]:
    """Whose init sets each parameter's value: the module that created it (a weight tied after
    construction keeps its creator's values, as in eager construction), else the first owner
    in ``modules()`` order."""
    made_by = {id(t): key for key, record in records.items() for t in record.created}
    return {pid: next((m for m in mods if id(m) == made_by.get(pid)), mods[0])
            for pid, mods in owners.items()}


class Materializer:
    """Turns meta tensors into real ones on ``device``, one owning module at a time, each
    initialised from the generator state its eager construction would have started from."""

    def __init__(self, model: nn.Module, device: torch.device, init_fn: InitFn | None) -> None:
        self.device = device
        self.init_fn = init_fn or default_init
        self.owners: dict[int, list[nn.Module]] = {}
        self.modules = [m for m in model.modules()]
        for module in self.modules:
            for p in module.parameters(recurse=False):
                self.owners.setdefault(id(p), []).append(module)
        pending = [m for m in self.modules if _owns_meta(m)]
        records = {}
        for module in pending:
            record = _RECORDS.pop(module, None)  # tensors it holds are released with it
            if record is not None and record.device == device:
                records[id(module)] = record
        # Put on meta without meta_init: as if built eagerly now, in modules() order. This
        # moves the generators on, as eager construction would have.
        unseen = [type(m).__name__ for m in pending if id(m) not in records]
        if records and unseen:
            warn_inexact(f"{len(unseen)} modules on meta (e.g. a {unseen[0]}) were not seen "
                         "being built in meta_init (copies made with copy.deepcopy, as "
                         "nn.TransformerEncoder makes of its layer, or modules put on meta "
                         "another way): they are initialised as if built with the engine")
        self.starts = _advance([m for m in pending if id(m) not in records], device,
                               self.init_fn)
        self.starts.update({key: record.start for key, record in records.items()})
        self.creator = _creators(self.owners, records)
        self.done: set[int] = set()

    def _materialize(self, module: nn.Module) -> None:
        if id(module) in self.done:
            return
        self.done.add(id(module))
        if not _owns_meta(module):
            return
        # Tied parameters another module created: init runs on scratch in their place, so the
        # generator moves as in eager construction and their creator's values stay.
        foreign = [n for n, p in module._parameters.items()
                   if p is not None and self.creator[id(p)] is not module]
        with torch.no_grad():
            for name, p in module._parameters.items():
                if p is not None and p.is_meta and name not in foreign:
                    # swap keeps the Parameter object: ties and optimizer refs hold
                    real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                        requires_grad=p.requires_grad)
                    torch.utils.swap_tensors(p, real)
            for name, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty_like(b, device=self.device)
            with _rng_at(self.device, self.starts[id(module)]), \
                    _scratch(module, self.device, foreign):
                self.init_fn(module)

    def ensure(self, params: Iterable[nn.Parameter]) -> None:
        """Make ``params`` real, initialising every module that owns one of them."""
        for p in params:
            if p.is_meta:
                for module in self.owners.get(id(p), []):
                    self._materialize(module)

    def finish(self) -> None:
        """Whatever is still on meta (frozen parameters, buffers)."""
        for module in self.modules:
            if _owns_meta(module):
                self._materialize(module)
