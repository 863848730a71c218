"""``ZeroAccelerator`` and what its ``prepare`` returns: the model and optimizer wrappers that
route calls to the engine, the training loop's hooks (``backward``, clipping, ``no_sync``),
weights and Accelerate's state folder with the engine's sharded checkpoint in it. The options
come from ``plugin.py``; the state folder's files are checked by ``state.py``."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DynamoBackend, InitProcessGroupKwargs
from torch import nn
from torch.utils.data import DataLoader

from ...checkpoint import read as checkpoint_read
from ...checkpoint.dcp import dcp_directories
from ...checkpoint.errors import CheckpointError
from ...checkpoint.export import PlainLayout, parse_size
from ...checkpoint.save_hub import save_hub
from ...checkpoint.verify import member
from ...comm import groups
from ...core.devices import canonical_device
from ...core.precision import make_policy
from ...engine import ZeroEngine
from ..step_turns import StepTurns
from .frozen import build_frozen
from .models import ZeroFrozenModel, ZeroModel
from .plugin import ZeroPlugin
from .state import (
    CHECKPOINT_SUBDIR,
    CHECKPOINT_TAG,
    check_state_folder,
    custom_states_from,
    read_custom_states,
)


# ---------------------------------------------------------------------------------- wrappers
class ZeroOptimizer(AcceleratedOptimizer):
    """What ``prepare`` returns for each optimizer: ``step``/``zero_grad`` drive the engine on
    the micro-batches where Accelerate synchronises gradients, and do nothing on the others.
    With several optimizers, the first ``step()`` after a backward steps all of them and the
    others' ``step()`` take their turn (``turns``, shared by the model's optimizers).

    ``param_groups`` are the user's optimizer's, so schedulers and manual lr changes work (the
    engine copies them onto its inner, sharded optimizer at every step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine: ZeroEngine,
                 turns: StepTurns) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self.turns = turns

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        if self.gradient_state.sync_gradients:
            # False: non-finite gradients (fp16 overflow), the step was skipped for all parts.
            self._is_overflow = not self.turns.step(self.optimizer)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.gradient_state.sync_gradients:
            self.engine.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """This optimizer's whole state in torch's format (a collective that materialises it;
        ``accelerator.save_state()`` writes shards instead)."""
        return self.optimizer.state_dict()  # the engine's, through the user's object

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


# ---------------------------------------------------------------------------------- accelerator
class ZeroAccelerator(Accelerator):
    """``Accelerator`` whose prepared model and optimizer are trained by ``ZeroEngine``.

    Takes ``Accelerator``'s keyword arguments plus ``zero_plugin`` (default:
    ``ZeroPlugin.from_config()``). One model and its optimizer(s) per accelerator, passed to
    the same ``prepare`` call. Multi-process CPU launches need no ``cpu=True``: without an
    accelerator device it is set, which is what makes Accelerate use gloo across processes.
    """

    def __init__(self, *, zero_plugin: ZeroPlugin | None = None, **kwargs: Any) -> None:
        plugin = zero_plugin if zero_plugin is not None else ZeroPlugin.from_config()
        _reject_other_backends(kwargs)
        requested = kwargs.pop("mixed_precision", None)
        if requested is None:
            requested = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        mixed_precision = str(requested).lower()
        config = plugin.resolve(mixed_precision)  # fails before any process group exists
        if not kwargs.get("cpu") and not has_accelerator_device():
            kwargs["cpu"] = True
        handlers = list(kwargs.get("kwargs_handlers") or [])
        if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
            # The group Accelerate creates waits as long as the engine's collectives do.
            handlers.append(InitProcessGroupKwargs(
                timeout=datetime.timedelta(seconds=config.timeout)))
            kwargs["kwargs_handlers"] = handlers
        self._zero_mixed_precision = mixed_precision
        # Under a restarting launcher the group must be created per attempt (Accelerate skips
        # creating its own when one exists).
        groups.init_restartable_group("gloo" if kwargs.get("cpu") else "nccl",
                                           config.timeout)
        # Accelerate must not autocast or build a GradScaler: the engine owns precision.
        super().__init__(mixed_precision="no", **kwargs)
        self.zero_plugin = plugin
        self.zero_config = config
        self._zero_model: ZeroModel | None = None
        self._zero_optimizers: list[ZeroOptimizer] = []
        self._zero_turns: StepTurns | None = None
        self._zero_frozen: list[ZeroFrozenModel] = []
        _ensure_process_group(self.device, self.num_processes)

    @property
    def mixed_precision(self) -> str:
        """Accelerate's name for the precision in use (the engine applies it)."""
        return self._zero_mixed_precision

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Iterator[None]:
        """Accelerate's ``autocast()`` block (TRL's trainers score and compute losses in one)
        in the engine's precision: the autocast its forward runs in under "-autocast", as
        Accelerate's own under ``mixed_precision``; nothing under the other precisions, whose
        weights already have their compute dtype. ``autocast_handler`` (``AutocastKwargs``)
        overrides the accelerator's, as in Accelerate."""
        dtype = make_policy(self.zero_config).autocast_dtype
        handler = autocast_handler if autocast_handler is not None else self.autocast_handler
        if dtype is None:
            yield
            return
        kwargs = handler.to_kwargs() if handler is not None else {}
        with torch.autocast(self.device.type, dtype=dtype, **kwargs):
            yield

    @property
    def engine(self) -> ZeroEngine:
        if self._zero_model is None:
            raise RuntimeError("no model prepared yet: call accelerator.prepare(model, optimizer)")
        return self._zero_model.engine

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """The model trained by ZeRO is the one the optimizer(s) were built on, passed in the
        same call (several optimizers: one engine over all of them, one wrapper each); data
        loaders, schedulers and any other model get Accelerate's own preparation."""
        again = self._prepared_again(args)
        if again is not None:
            return again
        found = self._zero_positions(args)
        if found is None:
            return super().prepare(*args, device_placement=device_placement)
        placements = list(device_placement) if device_placement else [None] * len(args)
        if len(placements) != len(args):
            raise ValueError(f"device_placement should have {len(args)} elements, one per object")
        m, opts = found
        results = list(args)
        results[m], wrappers = self._build_engine(args[m], [args[o] for o in opts], placements[m])
        for o, wrapper in zip(opts, wrappers):
            results[o] = wrapper
        rest = [i for i in range(len(args)) if i != m and i not in opts]
        if rest:
            prepared = super().prepare(*(args[i] for i in rest),
                                       device_placement=[placements[i] for i in rest])
            prepared = (prepared,) if len(rest) == 1 else prepared
            for i, obj in zip(rest, prepared):
                results[i] = obj
        return tuple(results) if len(results) > 1 else results[0]

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Accelerate's, but at stage 3 a model prepared for evaluation only (a reference,
        reward or teacher model beside the trained one: TRL's trainers ask for it so) is
        sharded by a frozen engine of its own (``frozen.py``): 1/N of its weights per rank,
        no gradients, no optimizer state. At stages 0-2 it stays whole on every rank, as the
        trained model's parameters do."""
        zero = self._zero_model
        if zero is not None and (model is zero or model is zero.module):
            return zero
        shard = (evaluation_mode and self.zero_config.stage == 3 and not self._trains(model)
                 and any(True for _ in model.parameters()))  # a parameter-free one as before
        if isinstance(model, ZeroFrozenModel) or shard:
            return self._prepare_frozen(model, device_placement)
        return super().prepare_model(model, device_placement, evaluation_mode)

    def _trains(self, model: nn.Module) -> bool:
        """Whether ``model`` is (or will be) the one prepared with its optimizer; a training
        loop that knows its model before ``prepare`` (Trainer) says so here."""
        return False

    def _prepare_frozen(self, model: nn.Module, device_placement: bool | None) -> nn.Module:
        if isinstance(model, ZeroFrozenModel):
            if all(m is not model for m in self._zero_frozen):
                raise ValueError("this frozen ZeRO model was prepared by another accelerator")
            return model
        if isinstance(model, ZeroModel):
            raise ValueError("prepare_model(evaluation_mode=True) got a model another "
                             "ZeroAccelerator trains; pass an unwrapped model")
        placement = self.device_placement if device_placement is None else device_placement
        frozen = build_frozen(model, self.zero_config, len(self._zero_frozen),
                              self.device if placement else None)
        self._zero_frozen.append(frozen)
        self._models.append(frozen)
        return frozen

    def _prepared_again(self, args: tuple[Any, ...]) -> Any:
        """The objects ``prepare`` already returned, when it is given the ZeRO model (or its
        wrapper) and its optimizer wrappers again, as a loop that prepares on every run does
        (``transformers.Trainer.train()`` called twice); None for anything else."""
        zero = self._zero_model
        if zero is None or not args:
            return None
        mine = {id(zero), id(zero.module), *(id(o) for o in self._zero_optimizers)}
        if not all(id(a) in mine for a in args):
            return None
        out = tuple(zero if isinstance(a, nn.Module) else a for a in args)
        return out if len(out) > 1 else out[0]

    def _zero_positions(self, args: tuple[Any, ...]) -> tuple[int, list[int]] | None:
        """Positions of the model and its optimizers for the engine, or None when the call has
        neither."""
        models = [i for i, a in enumerate(args)
                  if isinstance(a, nn.Module) and not isinstance(a, ZeroModel)]
        optimizers = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)
                      and not isinstance(a, AcceleratedOptimizer)]
        if not optimizers:
            if models and self._zero_model is None:
                raise ValueError(
                    "ZeroAccelerator.prepare needs the trained model and its optimizer in the same "
                    "call (the engine shards them together): prepare(model, optimizer, ...)"
                )
            return None  # e.g. only data loaders, or a frozen extra model after the ZeRO one
        owners = {o: _model_of(args, o, models) for o in optimizers}
        return _owner_of_all(args, owners, models), optimizers

    def _build_engine(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                      placement: bool | None) -> tuple[ZeroModel, list[ZeroOptimizer]]:
        if self._zero_model is not None:
            raise ValueError("ZeroAccelerator trains one model; it already prepared one")
        on_meta = any(p.is_meta for p in model.parameters())
        if (self.device_placement if placement is None else placement) and not on_meta:
            # Keeps Parameter identities, so the optimizer stays valid. Accelerate names the
            # CPU "cpu:0", which CPU tensors never report: .to() would copy every weight
            # (the whole model once more, for one loaded whole).
            model.to(canonical_device(self.device))
        # A model on the meta device is materialised by the engine, one unit at a time.
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            warnings.warn("ZeroAccelerator does not torch.compile the ZeRO model; the accelerate "
                          "config's dynamo settings are ignored for it", stacklevel=3)
        engine = ZeroEngine(model, optimizers, self.zero_config)  # several: checked disjoint
        self._zero_turns = turns = StepTurns(engine)
        self._zero_model = ZeroModel(engine)
        self._zero_optimizers = [ZeroOptimizer(opt, engine, turns) for opt in optimizers]
        for obj in (self._zero_model, *self._zero_optimizers):
            obj._is_accelerate_prepared = True
        self._models.append(self._zero_model)
        self._optimizers.extend(self._zero_optimizers)  # found by prepare_scheduler
        return self._zero_model, self._zero_optimizers

    # ------------------------------------------------------------------ training loop
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Used by ``accumulate()`` on non-final micro-batches: the engine skips all reduction."""
        if isinstance(model, ZeroModel):
            with model.engine.no_sync():
                yield
        else:
            with super().no_sync(model):
                yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self._zero_model is None:
            return super().backward(loss, **kwargs)
        if kwargs.pop("learning_rate", None) is not None:
            raise ValueError("learning_rate= (LOMO optimizers) is not supported by ZeroAccelerator")
        if self._zero_turns is not None:
            self._zero_turns.backward()
        # Same averaging over the accumulation window as Accelerate; fp16 scaling is the engine's.
        self.engine.backward(loss / self.gradient_accumulation_steps, **kwargs)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor | None:
        """Clip by the global norm over all shards and return it. On micro-batches that do not
        synchronise (``not accelerator.sync_gradients``) gradients are local partial sums, so
        nothing is clipped and None is returned."""
        if self._zero_model is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self._check_all_parameters(parameters, "clip_grad_norm_")
        if not self.sync_gradients:
            return None
        return self.engine.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        if self._zero_model is None:
            return super().clip_grad_value_(parameters, clip_value)
        self._check_all_parameters(parameters, "clip_grad_value_")
        if self.sync_gradients:  # like clip_grad_norm_: only reduced gradients can be clipped
            self.engine.clip_grad_value_(float(clip_value))

    def _check_all_parameters(self, parameters: Iterable[torch.Tensor], what: str) -> None:
        given = {id(p) for p in parameters}
        model = self.engine.module
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        if not trainable <= given <= {id(p) for p in model.parameters()}:
            raise ValueError(
                f"{what} under ZeRO works on all of the prepared model's trainable parameters "
                "at once (the norm is global over shards): pass model.parameters()"
            )

    # ------------------------------------------------------------------ data
    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Accelerate's loader for the rest of a resumed epoch, whose iterator leaves the global
        torch generator alone, so a resume is bit-exact with dropout (and a shuffled loader).

        Starting a DataLoader iterator draws its workers' base seed from the global CPU
        generator (unless the loader has its own ``generator``). The uninterrupted run drew it
        at the start of the epoch, before ``save_state`` recorded the generator; the resumed run
        would draw it again right after ``load_state`` restored it, shifting every later CPU
        draw (dropout) by one. This loader draws it from a copy of the global generator taken
        here instead: the seed plain Accelerate would use, the global stream untouched. With
        ``num_batches=0`` the resumed run starts a new epoch, as the uninterrupted one did
        (drawing), so the loader is Accelerate's own. Iterate it for that epoch only, as
        Accelerate documents; later epochs use the original loader."""
        skipped = super().skip_first_batches(dataloader, num_batches)
        if num_batches > 0:
            _seed_workers_from_a_copy(skipped)
        return skipped

    # ------------------------------------------------------------------ weights
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        if isinstance(model, (ZeroModel, ZeroFrozenModel)):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights with the user's keys, on every rank (a collective: call
        it on all ranks). This holds the WHOLE model on every rank; ``save_model`` streams
        from the shards instead."""
        zero = self._zero_model
        if zero is not None and (model is zero or model is zero.module):
            return self.engine.full_state_dict()
        for frozen in self._zero_frozen:
            if model is frozen or model is frozen.module:
                return frozen.engine.full_state_dict()
        return super().get_state_dict(model, unwrap)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str],
                   max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
        """What Accelerate's ``save_model`` writes (the model's state dict under its own keys,
        ``model.safetensors`` or shards and an index split at ``max_shard_size``, a tensor
        named twice written once), streamed from the shards: the main process writes, each
        tensor gathered onto it alone, a bucket at a time (a collective: call it on every
        process)."""
        zero = self._zero_model
        if zero is None or not (model is zero or model is zero.module):
            return super().save_model(model, save_directory, max_shard_size=max_shard_size,
                                      safe_serialization=safe_serialization)
        if not safe_serialization:
            raise ValueError("save_model(safe_serialization=False) asks for pickled files; "
                             "the ZeRO model is written as safetensors only")
        save_hub(self.engine, save_directory, max_shard_bytes=parse_size(max_shard_size),
                 layout=PlainLayout(drop_aliases=True))
        return None

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Path:
        """Accelerate's state folder (schedulers, samplers, RNG, step, custom objects) with the
        engine's sharded model and optimizer in ``zero_checkpoint/``; every rank calls it."""
        if self._zero_model is None:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        with self._zero_objects_hidden():
            location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        self.save_zero_checkpoint(Path(location))
        return Path(location)

    def save_zero_checkpoint(self, folder: str | os.PathLike[str]) -> Path:
        """The engine's sharded model and optimizer (and the optimizer's param groups) in
        ``folder/zero_checkpoint``; every rank calls it, and it returns once all have written."""
        # Schedulers restore their own fields but not the optimizer's lr: keep the groups too.
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.engine.user_optimizer.param_groups]
        # A fixed tag: saving into the same folder again replaces it, as Accelerate's files are.
        self.engine.save_checkpoint(Path(folder) / CHECKPOINT_SUBDIR, tag=CHECKPOINT_TAG,
                                    client_state={"param_groups": groups})
        self.wait_for_everyone()  # nobody reads or prunes the folder before every rank wrote
        return Path(folder) / CHECKPOINT_SUBDIR

    def load_state(self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """Validate, then restore: the engine's checkpoint is checked completely and read,
        the state folder's files are checked (regular files inside it), registered objects'
        files are unpickled with ``weights_only=True`` only (Accelerate itself uses
        ``weights_only=False``); then Accelerate restores its own state and the engine
        commits. A refused checkpoint leaves the ZeRO model and optimizer as they were."""
        if self._zero_model is None:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        folder = Path(self._checkpoint_dir(input_dir))
        check_state_folder(folder)
        custom = read_custom_states(folder, len(self._custom_objects))

        def restore_accelerate() -> None:
            with self._zero_objects_hidden(), custom_states_from(custom):
                Accelerator.load_state(self, str(folder), load_kwargs, **load_model_func_kwargs)

        self.load_zero_checkpoint(folder, then=restore_accelerate)

    def load_zero_checkpoint(self, folder: str | os.PathLike[str],
                             then: Callable[[], None] | None = None) -> None:
        """Validate, then restore the engine from ``folder/zero_checkpoint`` (or DeepSpeed's or
        DCP's files in ``folder`` itself), then the optimizer's param groups saved beside ours.
        ``then()`` runs once every check passed and before the engine changes, so its refusal
        leaves the engine as it was."""
        folder = Path(folder)
        # A folder Accelerate's DeepSpeed integration saved holds DeepSpeed's own checkpoint
        # (``latest`` and a ``pytorch_model`` tag) beside Accelerate's files, its FSDP
        # integration two DCP directories (model and optimizer): either is read in place.
        source = folder / CHECKPOINT_SUBDIR
        latest = folder / "latest"  # of any kind: the reader refuses a FIFO or a link out
        if not source.exists() and (latest.exists() or latest.is_symlink()
                                    or dcp_directories(folder)):
            source = folder
        current = self.engine.user_optimizer.param_groups

        def before_commit(client: dict[str, Any] | None, kind: str) -> None:
            # DeepSpeed's and DCP's groups are restored by the engine itself.
            groups = (client or {}).get("param_groups", []) if kind == "zero_strategy" else current
            if len(groups) != len(current):
                raise CheckpointError(f"{folder}: saved with {len(groups)} optimizer param "
                                      f"groups, the optimizer has {len(current)}")
            if then is not None:
                then()

        client = checkpoint_read.load(self.engine, source, before_commit=before_commit) or {}
        if source == folder:
            return  # DeepSpeed's client state is not ours: its groups were restored already
        for group, saved in zip(current, client.get("param_groups", [])):
            group.update(saved)

    def _checkpoint_dir(self, input_dir: str | None) -> str:
        """``input_dir``, or the latest automatically named checkpoint (as Accelerate picks it)."""
        if input_dir is not None:
            path = os.path.expanduser(input_dir)
            if not os.path.isdir(path):
                raise ValueError(f"checkpoint folder {path} does not exist")
            return path
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = os.path.join(self.project_dir, "checkpoints")
        folders = sorted(os.listdir(root), key=lambda f: int(re.findall(r"(\d+)$", f)[0]))
        return str(member(Path(root), Path(root, folders[-1]), "checkpoint folder",
                          directory=True))

    @contextlib.contextmanager
    def _zero_objects_hidden(self) -> Iterator[None]:
        """Accelerate's save/load without the ZeRO model and optimizer, which have no full
        state dict: everything else it checkpoints keeps its native format."""
        models, optimizers = self._models, self._optimizers
        self._models = [m for m in models if m is not self._zero_model]
        self._optimizers = [o for o in optimizers
                            if not any(o is z for z in self._zero_optimizers)]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def free_memory(self, *objects: Any) -> Any:
        if self._zero_model is not None:
            self.engine.close()
            self._zero_model, self._zero_optimizers, self._zero_turns = None, [], None
        for frozen in self._zero_frozen:
            frozen.engine.close()
        self._zero_frozen = []
        return super().free_memory(*objects)


# ---------------------------------------------------------------------------------- helpers
def _model_of(args: tuple[Any, ...], optimizer: int, models: list[int]) -> int | None:
    """Position of the model ``args[optimizer]`` was built on (the one holding its parameters),
    or None for an optimizer that holds none yet (every param group empty): torch accepts
    one, and it follows the call's other optimizers (``_zero_positions``)."""
    held = {id(p) for group in args[optimizer].param_groups for p in group["params"]}
    if not held:
        return None
    owners = [i for i in models if any(id(p) in held for p in args[i].parameters())]
    if not owners:
        raise ValueError(
            f"prepare() got an optimizer ({type(args[optimizer]).__name__}, argument "
            f"{optimizer}) but not the model it was built on; pass them in the same call")
    return owners[0]


def _owner_of_all(args: tuple[Any, ...], owners: dict[int, int | None],
                  models: list[int]) -> int:
    """The one model the call's optimizers train. Optimizers with no parameter yet follow the
    others; when none holds one, the call's only model (the engine then names what is
    missing: the trainable parameters, or that nothing is trainable)."""
    found = sorted({m for m in owners.values() if m is not None})
    if len(found) > 1:
        raise ValueError(
            "ZeroAccelerator trains one model, with all of its optimizers: the optimizers "
            f"of this prepare() call (arguments {sorted(owners)}) are built on different "
            f"models (arguments {found})")
    if found:
        return found[0]
    if len(models) == 1:
        return models[0]
    names = ", ".join(f"{type(args[o]).__name__} (argument {o})" for o in owners)
    if not models:
        raise ValueError(f"prepare() got optimizers ({names}) but not the model they train; "
                         "pass them in the same call")
    raise ValueError(
        f"prepare() got optimizers whose param groups are all empty ({names}) and "
        f"{len(models)} models (arguments {models}): nothing says which model they train; "
        "build the optimizer over the model's parameters, or pass that model alone")


def _seed_workers_from_a_copy(loader: Any) -> None:
    """Give ``loader`` (or the torch DataLoader Accelerate wraps in it) a generator of its own
    for the base-seed draw its iterators make, a copy of the global CPU generator's state, when
    it has none. Its sampler is already built, so the generator is used for nothing else;
    a loader with the user's own generator is left as it is (that draw is part of its epoch)."""
    base = getattr(loader, "base_dataloader", loader)  # DataLoaderShard / Dispatcher wrap one
    if isinstance(base, DataLoader) and base.generator is None:
        copy = torch.Generator()
        copy.set_state(torch.get_rng_state())
        base.generator = copy


def _reject_other_backends(kwargs: dict[str, Any]) -> None:
    for name in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin",
                 "torch_tp_plugin", "parallelism_config"):
        if kwargs.get(name) is not None:
            raise ValueError(f"ZeroAccelerator replaces Accelerate's sharding: {name}= cannot be "
                             "combined with it")
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM"):
        if os.environ.get(var, "false").lower() == "true":
            raise ValueError(
                f"launched with {var}=true (a DeepSpeed/FSDP/Megatron accelerate config): "
                "ZeroAccelerator needs a plain multi-process config (distributed_type MULTI_GPU "
                "or MULTI_CPU), see conf/accelerate/multi_process.yaml"
            )


def has_accelerator_device() -> bool:
    probe = getattr(torch, "accelerator", None)
    if probe is not None and hasattr(probe, "is_available"):
        return bool(probe.is_available())
    return torch.cuda.is_available()


def _ensure_process_group(device: torch.device, num_processes: int) -> None:
    """The engine needs torch.distributed; a plain ``python script.py`` gets a group of one."""
    if groups.group_is_initialized():
        world = groups.group_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != num_processes:  # e.g. every rank would read the whole data set
        raise RuntimeError(
            f"{world} processes were launched but Accelerate counts {num_processes}: its state "
            "was probably created before the ZeroAccelerator without cpu=True (e.g. by "
            "PartialState() on a machine without GPUs); create the ZeroAccelerator first, or "
            "pass cpu=True to what created the state"
        )
    if not groups.group_is_initialized():
        groups.init_single_process_group(device)
