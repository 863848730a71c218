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
from its remembered state and the generator is put back. An init that writes another
module's tensor (nn.MultiheadAttention zeroing its ``out_proj.bias``) is not applied there:
the replay records the write with its generator state, and it is applied to that tensor when
the tensor is materialised, after its own init, as in eager construction, whichever of the two
modules is materialised first. ``meta_init`` (the strategies' init contexts) records the true
construction order and replays when the model is complete; a model put on meta any other way
is replayed when the engine is built, in ``modules()`` order (torch's modules that initialise
after building their children, ``LATE_INIT``, after those children).
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
    register_module_module_registration_hook,
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


# torch modules whose constructor builds their children, then calls ``self._reset_parameters()``
# and has no public ``reset_parameters()`` (torch 2.13: MultiheadAttention in activation.py,
# Transformer in transformer.py); that call is their init, and it runs after their children's.
# tests/quick/test_sharded_init.py checks this list against the classes of torch.nn.
LATE_INIT: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.Transformer)


def default_init(module: nn.Module) -> None:
    """``module.reset_parameters()``, or for a ``LATE_INIT`` module the ``_reset_parameters()``
    its constructor calls; other modules cannot be initialised implicitly."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    elif isinstance(module, LATE_INIT):
        module._reset_parameters()
    else:
        raise ValueError(
            f"{type(module).__name__} has parameters on the meta device and no "
            "reset_parameters(): pass param_init_fn= to ZeroEngine (for a transformers model, "
            "param_init_fn=model._init_weights) so its values are defined"
        )


# Modules whose initialisation the code that built them defines, consulted before the engine's
# (or meta_init's) init function: a model built from pretrained weights initialises only what
# its folder lacks (integrations/hf/pretrained.py). Weak keys: a discarded model takes its entries.
_OWN_INIT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def set_module_init(modules: Iterable[nn.Module], init_fn: InitFn) -> None:
    """Initialise ``modules`` with ``init_fn``, whatever init function is given later."""
    for module in modules:
        _OWN_INIT[module] = init_fn


def _init(module: nn.Module, default: InitFn) -> None:
    _OWN_INIT.get(module, default)(module)


Preparer = Callable[[nn.Module], None]
_PREPARERS: list[Preparer] = []
"""Run on a model before the engine materialises it: a library that adds modules to a model
already on meta (PEFT's adapters on a streamed pretrained model, which it builds on the CPU
and then moves onto meta, dropping their values) registers their init here
(``set_module_init``), or refuses what it cannot initialise. Integrations add to it; the core
never imports them."""


def register_preparer(prepare: Preparer) -> None:
    if prepare not in _PREPARERS:
        _PREPARERS.append(prepare)


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


# Replay positions of module inits and of their writes to other modules' tensors, one count
# for every replay (meta_init's and the engine's): sorting by it is sorting by construction.
_SEQUENCE = itertools.count()
_Where = int | str  # a tensor argument's position in ``args``, or its keyword


@dataclass
class _Write:
    """An in-place op that one module's init applied to another module's tensor (nn.Transformer
    drawing its layers' weights again, MultiheadAttention zeroing ``out_proj.bias``). Eagerly
    it lands after the target's own init; here it is applied to the target when that is
    materialised, after its own init, from the generator state it ran from, so the value is
    eager construction's whatever order units are materialised in."""

    seq: int
    rng: RngState
    func: Callable[..., Any]
    args: tuple
    kwargs: dict
    where: _Where

    def apply(self, tensor: torch.Tensor, device: torch.device) -> None:
        args, kwargs = _put(self.args, self.kwargs, self.where, tensor)
        with _rng_at(device, self.rng):
            self.func(*args, **kwargs)


@dataclass
class _Replayed:
    """What replaying inits in construction order learnt: each module's generator state and
    position, and the writes other modules' inits made to each tensor (by its id)."""

    starts: dict[int, RngState]
    seqs: dict[int, int]
    writes: dict[int, list[_Write]]


def _advance(modules: Iterable[nn.Module], device: torch.device, init_fn: InitFn,
             registered: dict[int, torch.Tensor]) -> _Replayed:
    """Run each module's init on throw-away tensors, in the given (construction) order, one
    module at a time: the generators move exactly as eager construction moved them.
    ``registered``: the model's tensors, to tell another module's tensor from a temporary."""
    out = _Replayed({}, {}, {})
    last: RngState | None = None
    watch = _ForeignWrites(device, registered, out.writes)
    with torch.no_grad():
        for module in modules:
            state = rng_state(device)
            if last is not None and _same(state, last):
                state = last  # a CPU state is 5 KB; repeats are shared
            out.starts[id(module)] = last = state
            out.seqs[id(module)] = next(_SEQUENCE)
            params = [n for n, p in module._parameters.items() if p is not None]
            buffers = [n for n, b in module._buffers.items() if b is not None]
            with _scratch(module, device, params, buffers), watch.running(module, set()):
                _init(module, init_fn)
    if watch.unknown is not None:
        warn_inexact(f"the init of a {watch.unknown} writes in place to another module's "
                     "tensor through a view, or with other tensors as arguments, which cannot "
                     "be replayed on that tensor alone")
    return out


class _ForeignWrites(TorchFunctionMode):
    """Watches one module's init for in-place ops on other modules' tensors (``registered``,
    directly or through ``.data``). Such an op is not applied: its target may be meta or
    sharded already. With ``writes`` (replaying) it is recorded for its target instead;
    when materialising, the target got it from that record. A random one draws on a scratch
    tensor, so the generator moves as in eager construction either way."""

    def __init__(self, device: torch.device, registered: dict[int, torch.Tensor],
                 writes: dict[int, list[_Write]] | None) -> None:
        super().__init__()
        self.device, self.registered, self.writes = device, registered, writes
        self.module: nn.Module | None = None
        self.own: set[int] = set()
        self.aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # p.data -> p
        self.unknown: str | None = None  # a module whose init wrote what cannot be replayed

    @contextmanager
    def running(self, module: nn.Module, own: set[int]) -> Iterator[None]:
        self.module, self.own = module, own
        try:
            with self:
                yield
        finally:
            self.aliases.clear()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.data:  # `p.data.normal_()` idiom
            out = func(*args, **kwargs)
            self.aliases[id(out)] = (out, args[0])
            return out
        where = _in_place_target(func, args, kwargs)
        if where is None:
            return func(*args, **kwargs)
        target = _at(args, kwargs, where)
        owned = self._foreign(target)
        view = owned is None and target._base is not None
        if view:
            owned = self._foreign(target._base)
        if owned is None:
            if target.is_meta:
                self._unknown()
            return func(*args, **kwargs)
        if view:  # which elements it wrote is not kept: not replayable
            self._unknown()
        elif self.writes is not None:
            self._record(func, args, kwargs, where, owned)
        if getattr(func, "__name__", "") in _RANDOM_INITS:
            scratch = torch.empty(target.shape, dtype=target.dtype, device=self.device)
            args, kwargs = _put(args, kwargs, where, scratch)
            func(*args, **kwargs)
        return target

    def _foreign(self, tensor: torch.Tensor) -> torch.Tensor | None:
        alias = self.aliases.get(id(tensor))
        if alias is not None and alias[0] is tensor:
            tensor = alias[1]
        found = self.registered.get(id(tensor))
        return found if found is tensor and id(tensor) not in self.own else None

    def _unknown(self) -> None:
        if self.writes is not None and self.unknown is None:  # reported once, when replaying
            self.unknown = type(self.module).__name__

    def _record(self, func: Any, args: tuple, kwargs: dict, where: _Where,
                target: torch.Tensor) -> None:
        args, kwargs = _put(args, kwargs, where, None)
        if any(isinstance(a, (torch.Tensor, torch.Generator)) for a in (*args, *kwargs.values())):
            self._unknown()
            return
        assert self.writes is not None
        self.writes.setdefault(id(target), []).append(
            _Write(next(_SEQUENCE), rng_state(self.device), func, args, kwargs, where))


def _in_place_target(func: Any, args: tuple, kwargs: dict) -> _Where | None:
    """Where an in-place op's target is (its first tensor), or None for other ops."""
    name = getattr(func, "__name__", "")
    if not (name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))):
        return None
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i
    return next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)


def _at(args: tuple, kwargs: dict, where: _Where) -> Any:
    return args[where] if isinstance(where, int) else kwargs[where]


def _put(args: tuple, kwargs: dict, where: _Where, value: Any) -> tuple[tuple, dict]:
    if isinstance(where, int):
        return (*args[:where], value, *args[where + 1:]), kwargs
    return args, {**kwargs, where: value}


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
    generators and its place in construction order, the parameters it created (their values
    are its init's to set) and what other modules' inits wrote to them (by tensor id)."""

    device: torch.device
    start: RngState
    seq: int
    created: list[torch.Tensor]
    writes: dict[int, list[_Write]]


# Filled when a meta_init block ends, consumed by the Materializer. Weak keys: a discarded
# model takes its records with it. (Parameters are never weakly referenced: swap_tensors
# refuses tensors with weak references.)
_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_ACTIVE: list[_ConstructionOrder] = []


class _ConstructionOrder(TorchFunctionMode):
    """Watches a model being built on meta: which module registers each tensor first, and when
    a random initialiser first writes to each module's parameters. That is the order in which
    eager construction draws: a module may register its parameters before its children and
    initialise them after (nn.MultiheadAttention), or create them after its children. Also
    which meta tensors are clones of which (``copy.deepcopy`` registers nothing: that is how
    nn.TransformerEncoder's layers are made), and when each module last registered a child
    (nn.Transformer's init runs right after its last one)."""

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
        # id(storage) -> (storage, source): a clone's storage stays its own (and the same
        # object) when a Parameter wraps it, so it identifies the copy's tensors.
        self.clones: dict[int, tuple[Any, torch.Tensor]] = {}
        self.parents: dict[int, tuple[nn.Module, int]] = {}  # id -> (module, last child's tick)

    def on_child(self, module: nn.Module, name: str, child: Any) -> None:
        if child is not None:
            self.parents[id(module)] = (module, next(self.clock))

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
        elif getattr(func, "__name__", "") in ("clone", "__deepcopy__"):
            source = self._source_of(args[0])
            if source is not None and isinstance(out, torch.Tensor) and out.is_meta:
                storage = out.untyped_storage()
                self.clones[id(storage)] = (storage, source)
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

    def _source_of(self, tensor: Any) -> torch.Tensor | None:
        """The recorded tensor ``tensor`` is (through ``.data``) or is a copy of."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return None
        owned = self._owner_of(tensor)
        if owned is not None:
            return owned[0]
        clone = self.clones.get(id(tensor.untyped_storage()))
        return clone[1] if clone is not None else None

    def in_order(self, late_parents: bool) -> list[nn.Module]:
        """Modules still holding meta tensors, by when their init drew in eager construction
        (their first random draw; for a module whose draws were not seen, e.g. parameters
        made by ``torch.randn`` before registering, its first registration); with
        ``late_parents``, ``LATE_INIT`` modules holding none themselves (nn.Transformer),
        right after they registered their last child."""
        pending = [m for m in self.modules if _owns_meta(m)]
        keys = {id(m): self.drawn.get(id(m), self.registered[id(m)]) for m in pending}
        for module, tick in self.parents.values() if late_parents else ():
            if isinstance(module, LATE_INIT) and id(module) not in keys and has_meta(module):
                pending.append(module)
                keys[id(module)] = tick
        return sorted(pending, key=lambda m: keys[id(m)])

    def copies(self) -> list[tuple[nn.Module, nn.Module, dict[int, torch.Tensor]]]:
        """Modules deep-copied from recorded ones, each with the module it copies and, by the
        id of each of its tensors, that tensor's source. Eagerly a copy starts with its
        source's values and draws nothing."""
        found = []
        seen: set[int] = set()
        for parent, _ in list(self.parents.values()):
            for module in parent.modules():
                if id(module) in seen or id(module) in self.registered:
                    continue
                seen.add(id(module))
                sources = {id(t): self._source_of(t) for t in _tensors(module, recurse=False)}
                makers = {id(self.creator[id(s)][1]) if s is not None and id(s) in self.creator
                          else None for s in sources.values()}
                if sources and None not in makers and len(makers) == 1:
                    source = self.creator[id(next(iter(sources.values())))][1]
                    found.append((module, source, sources))
        return found

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
             register_module_buffer_registration_hook(order.on_register),
             register_module_module_registration_hook(order.on_child)]
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
    # A LATE_INIT module without tensors of its own (nn.Transformer) is replayed only under the
    # default init: a param_init_fn is given modules with tensors to initialise.
    modules = order.in_order(late_parents=init_fn is default_init)
    again = order.reinitialised()
    if again is not None:
        warn_inexact(f"parameters of a {type(again).__name__} were randomly initialised "
                     "again after other modules' (e.g. a parent re-initialising its children, "
                     "as nn.Transformer does); the engine replays each module's init once")
    copies = [c for c in order.copies() if _owns_meta(c[1])]
    registered = {key: tensor for key, (tensor, _) in order.creator.items()}
    registered.update({id(t): t for copy, _, _ in copies for t in _tensors(copy, False)})
    replayed = _advance(modules, device, init_fn, registered)
    created: dict[int, list[torch.Tensor]] = {}
    for tensor, module in order.creator.values():
        created.setdefault(id(module), []).append(tensor)
    for module in modules:
        mine = created.get(id(module), [])
        writes = {id(t): replayed.writes[id(t)] for t in mine if id(t) in replayed.writes}
        _RECORDS[module] = _Record(device, replayed.starts[id(module)],
                                   replayed.seqs[id(module)], mine, writes)
    # A copy is initialised as its source was: from the same state, at the same place in
    # construction order, with what other inits wrote to the source (its values when copied;
    # a write to a kept source after the copy would be inherited too, none of torch's does)
    # and what they wrote to the copy itself.
    # Why nn.Transformer comes out bit for bit: eagerly its prototype layers' inits draw, the
    # encoder and decoder deep-copy them (no draws), then its _reset_parameters draws
    # xavier_uniform_ into every >1-dim weight of the copies. Here the prototypes are replayed,
    # then its init right after its last child; its draws into the copies are recorded with
    # their generator states and drawn on scratch, so the generator ends as eagerly. A copied
    # tensor is then materialised by its prototype's init from the prototype's state, the
    # prototype's writes (MultiheadAttention's zeroed out_proj.bias), then nn.Transformer's
    # xavier_uniform_ from its state: the same ops, from the same states, in the same order.
    for copy, source, sources in copies:
        writes = {}
        for key, src in sources.items():
            writes[key] = replayed.writes.get(id(src), []) + replayed.writes.get(key, [])
        _RECORDS[copy] = _Record(device, replayed.starts[id(source)], replayed.seqs[id(source)],
                                 list(_tensors(copy, False)), writes)


def _creators(owners: dict[int, list[nn.Module]],
              records: dict[int, _Record]) -> dict[int, nn.Module]:
    """Whose init sets each parameter's value: the module that created it (a weight tied after
    construction keeps its creator's values, as in eager construction), else the first owner
    in ``modules()`` order."""
    made_by = {id(t): key for key, record in records.items() for t in record.created}
    return {pid: next((m for m in mods if id(m) == made_by.get(pid)), mods[0])
            for pid, mods in owners.items()}


def _eager_order(model: nn.Module) -> list[nn.Module]:
    """The order eager construction initialises a model's modules in, as far as the module
    tree tells: ``modules()`` order, except that a ``LATE_INIT`` module comes after its
    descendants (its constructor builds them before its own init runs)."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        late = isinstance(module, LATE_INIT)
        if not late:
            order.append(module)
        for child in module.children():
            visit(child)
        if late:
            order.append(module)

    visit(model)
    return order


def _warn_unreplayable(modules: list[nn.Module], records: dict[int, _Record]) -> None:
    """torch modules whose construction the replay could not reproduce."""
    for module in modules:
        if isinstance(module, nn.Transformer) and has_meta(module) and id(module) not in records:
            warn_inexact("nn.Transformer's constructor draws every >1-dim weight of its "
                         "encoder and decoder again (xavier_uniform_) after building them from "
                         "copies of one layer, which is replayed only for a model built in "
                         "meta_init (or Lightning's configure_model, Fabric's init_module) "
                         "without a param_init_fn; here each layer keeps its own constructor's "
                         "init (Linear weights: kaiming_uniform_ bounds), as if built separately")
            return
    if records:
        return  # meta_init saw the copies being made, or the Materializer warns about them
    for module in modules:
        if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and has_meta(module):
            warn_inexact(f"nn.{type(module).__name__} starts its layers as copies of one layer, "
                         "which only meta_init sees; here each layer is initialised as if built "
                         "separately")
            return


class Materializer:
    """Turns meta tensors into real ones on ``device``, one owning module at a time, each
    initialised from the generator state its eager construction would have started from,
    then given what other modules' inits wrote to its tensors."""

    def __init__(self, model: nn.Module, device: torch.device, init_fn: InitFn | None) -> None:
        for prepare in _PREPARERS:
            prepare(model)
        self.device = device
        self.init_fn = init_fn or default_init
        self.owners: dict[int, list[nn.Module]] = {}
        self.modules = [m for m in model.modules()]
        for module in self.modules:
            for p in module.parameters(recurse=False):
                self.owners.setdefault(id(p), []).append(module)
        self.registered = {id(t): t for m in self.modules for t in _tensors(m, recurse=False)}
        records = self._take_records()
        _warn_unreplayable(self.modules, records)
        # Put on meta without meta_init: as if built eagerly now, in eager order. This moves
        # the generators on, as eager construction would have.
        unseen = [m for m in _eager_order(model) if _owns_meta(m) and id(m) not in records]
        # Modules with an init of their own (a preparer's rule) are initialised as meant.
        if records and (guessed := [m for m in unseen if m not in _OWN_INIT]):
            warn_inexact(f"{len(guessed)} modules on meta (e.g. a {type(guessed[0]).__name__}) "
                         "were not seen being built in meta_init (copies made with "
                         "copy.deepcopy, as nn.TransformerEncoder makes of its layer, or "
                         "modules put on meta another way): they are initialised as if built "
                         "with the engine")
        replayed = _advance(unseen, device, self.init_fn, self.registered)
        self.starts, self.seqs, self.writes = replayed.starts, replayed.seqs, replayed.writes
        for key, record in records.items():
            self.starts[key], self.seqs[key] = record.start, record.seq
            for tid, writes in record.writes.items():
                self.writes.setdefault(tid, []).extend(writes)
        self.creator = _creators(self.owners, records)
        self.done: set[int] = set()

    def _take_records(self) -> dict[int, _Record]:
        records = {}
        for module in self.modules:
            if _owns_meta(module) or isinstance(module, LATE_INIT):
                record = _RECORDS.pop(module, None)  # tensors it holds are released with it
                if record is not None and record.device == self.device:
                    records[id(module)] = record
        return records

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
            made = self._make_real(module, foreign)
            # Other inits' writes to these tensors, in construction order around the module's
            # own init (eagerly, a parent's init runs after its children's constructors).
            writes = sorted(((w, t) for key, t in made for w in self.writes.get(key, ())),
                            key=lambda wt: wt[0].seq)
            seq = self.seqs[id(module)]
            for write, tensor in writes:
                if write.seq < seq:
                    write.apply(tensor, self.device)
            watch = _ForeignWrites(self.device, self.registered, None)
            own = {id(t) for t in _tensors(module, recurse=False)}
            with _rng_at(self.device, self.starts[id(module)]), \
                    _scratch(module, self.device, foreign), watch.running(module, own):
                _init(module, self.init_fn)
            for write, tensor in writes:
                if write.seq > seq:
                    write.apply(tensor, self.device)

    def _make_real(self, module: nn.Module,
                   foreign: list[str]) -> list[tuple[int, torch.Tensor]]:
        """Real tensors for the module's meta ones: (id of the meta tensor, real tensor)."""
        made = []
        for name, p in module._parameters.items():
            if p is not None and p.is_meta and name not in foreign:
                # swap keeps the Parameter object: ties and optimizer refs hold
                real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                    requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, real)
                made.append((id(p), p))
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                new = module._buffers[name] = torch.empty_like(b, device=self.device)
                self.registered[id(new)] = new
                made.append((id(b), new))
        return made

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
