"""The one place where the engine attaches hooks to the user's model, and removes them.

Persistent hooks (per-parameter gradient hooks, per-unit forward hooks) are kept as handles
so ``HookSet.remove()`` leaves the model as it was found. Per-forward tensor hooks on module
outputs (``autograd.py``, registered by the runtime) live only as long as the autograd graph
they belong to.

Module classes are swapped for subclasses that route attribute reads, conversions and state
dicts through ``access.ParamAccess`` (as FSDP2's ``fully_shard`` swaps in ``FSDPModule``);
``ModulePatches.remove()`` puts the original classes back.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from .eager import eager

if TYPE_CHECKING:
    from .access import ParamAccess
    from .runtime import Runtime
    from .units import Unit


class HookSet:
    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._grad_hooked: set[int] = set()

    def install(self, units: list[Unit], runtime: Runtime) -> None:
        self.ensure_grad_hooks(units, runtime)
        for unit in units:
            if unit.module is not None and unit.param_store.gathers:
                self._install_forward(unit, runtime)

    def ensure_grad_hooks(self, units: list[Unit], runtime: Runtime) -> None:
        """Gradient hooks on every managed parameter that requires grad now. torch refuses a
        hook on a frozen tensor, so a parameter unfrozen later gets its hook here, before
        the next forward."""
        for unit in units:
            for index, param in enumerate(unit.params):
                if param.requires_grad and id(param) not in self._grad_hooked:
                    self._grad_hooked.add(id(param))
                    self._handles.append(
                        param.register_post_accumulate_grad_hook(_grad_hook(runtime, unit, index))
                    )

    def _install_forward(self, unit: Unit, runtime: Runtime) -> None:
        assert unit.module is not None

        # Collectives and storage resizes cannot be traced: under torch.compile the hooks
        # run eagerly between graphs.
        @eager
        def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            return runtime.pre_forward(unit, args, kwargs)

        @eager
        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            runtime.post_forward(unit, output)

        # prepend: gather before any user pre-hook may touch the parameters.
        self._handles.append(unit.module.register_forward_pre_hook(pre, prepend=True,
                                                                   with_kwargs=True))
        self._handles.append(unit.module.register_forward_hook(post))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._grad_hooked.clear()


GenerationContext = Callable[[], contextlib.AbstractContextManager[bool]]
"""The engine's generation mode; it yields whether the ranks must step together."""


class ModulePatches:
    """Swaps each module's class for a subclass that consults ``ParamAccess``; with
    ``generation`` (stage 3), a class's ``generate`` method runs inside that context."""

    def __init__(self, access: ParamAccess, watch: bool,
                 generation: GenerationContext | None = None) -> None:
        self.access = access
        self.watch = watch
        self.generation = generation
        self._classes: dict[type, type] = {}
        self._swapped: list[tuple[torch.nn.Module, type]] = []

    def install(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            original = type(module)
            if original not in self._classes:
                self._classes[original] = _patched_class(original, self.access, self.watch,
                                                         self.generation)
            module.__class__ = self._classes[original]
            self._swapped.append((module, original))

    def remove(self) -> None:
        for module, original in self._swapped:
            module.__class__ = original
        self._swapped.clear()


def _patched_class(cls: type, access: ParamAccess, watch: bool,
                   generation: GenerationContext | None) -> type:
    def _apply(self: Any, fn: Any, recurse: bool = True) -> Any:
        access.check_apply(self, fn)
        return super(patched, self)._apply(fn, recurse)

    def _load_from_state_dict(self: Any, state_dict: dict, prefix: str, local_metadata: Any,
                              strict: bool, missing: list, unexpected: list,
                              errors: list) -> None:
        handled = access.load_own(self, state_dict, prefix, errors)
        rest = {k: v for k, v in state_dict.items() if k not in handled}
        super(patched, self)._load_from_state_dict(rest, prefix, local_metadata, strict,
                                                   missing, unexpected, errors)
        missing[:] = [k for k in missing if k not in handled]

    def _save_to_state_dict(self: Any, destination: dict, prefix: str, keep_vars: bool) -> None:
        access.check_save(self, keep_vars)
        super(patched, self)._save_to_state_dict(destination, prefix, keep_vars)

    def __getattr__(self: Any, name: str) -> Any:
        value = super(patched, self).__getattr__(name)
        unit = access.unit_to_gather(value)
        if unit is not None:
            access.gather(unit)
        return value

    def named_parameters(self: Any, *args: Any, **kwargs: Any) -> Any:
        access.settle()  # also what parameters() returns
        return super(patched, self).named_parameters(*args, **kwargs)

    body: dict[str, Any] = {
        "_apply": _apply, "_load_from_state_dict": _load_from_state_dict,
        "_save_to_state_dict": _save_to_state_dict,
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
    }
    if watch:  # parameters that may be gathering: stage 3, or stages 1-2 after a step
        body["__getattr__"] = __getattr__
        body["named_parameters"] = named_parameters
    # A plain method only: a static or class method called ``generate`` is not a model's.
    original_generate = inspect.getattr_static(cls, "generate", None)
    if generation is not None and isinstance(original_generate, types.FunctionType):
        body["generate"] = _generating(original_generate, generation)
    patched = type(cls.__name__, (cls,), body)
    return patched


def _generating(generate: Callable[..., Any], generation: GenerationContext) -> Callable[..., Any]:
    """``generate`` (transformers' ``GenerationMixin.generate``, PEFT's, a model's own) run
    inside the engine's generation mode: each stage-3 unit gathered once for the call.

    Where ``generate`` takes ``synced_gpus`` (transformers') and the caller left it unset,
    the mode decides it: True while some unit is streamed (every forward is a collective, so
    a rank whose request is done keeps stepping with the others), False when all are held
    (nothing is communicated; each rank stops at its own length). A value the caller passed
    is kept."""
    takes_synced = "synced_gpus" in inspect.signature(generate).parameters

    @functools.wraps(generate)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with generation() as synced:
            if takes_synced and kwargs.get("synced_gpus") is None:
                kwargs["synced_gpus"] = synced
            return generate(self, *args, **kwargs)

    return wrapped


def _grad_hook(runtime: Runtime, unit: Unit, index: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        runtime.on_grad(unit, index, param)

    return hook
