"""Every private name of torch, Lightning, PEFT and Hydra that ``zero_strategy`` touches,
each with why it is needed and the versions it was checked on; transformers' and
Accelerate's are in ``integrations/hf/compat.py`` (same entry types, with the signatures the
Trainer's overrides need). Together they are the registry.

A private name can change in any release without notice. ``tests/quick/test_private_names.py``
reads all of ``zero_strategy/`` and fails on a private access of one of these packages that
no entry lists, and on an entry whose name the installed versions no longer have (unless it
is ``optional``: the code checks for it and falls back, as its ``why`` says). ``.ci/versions``
runs that test at the oldest and the newest releases the package allows.

Importing this module imports nothing: owners are strings, resolved on demand.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any

CHECKED_ON = {
    "torch": "2.13.0", "lightning": "2.6.6", "transformers": "5.23.0", "accelerate": "1.15.0",
    "peft": "0.21.2",
}
"""The releases every entry was checked on, by package (an entry's ``checked`` where it was
checked on others): the versions installed when the registry last changed."""


@dataclass(frozen=True, kw_only=True)
class _Name:
    """What every entry says: whose name it is, why we need it, where it was checked."""

    owner: str
    """``"package.module"`` (a function) or ``"package.module:Class"`` (a method; the part
    after the colon may be a dotted path of attributes)."""
    name: str
    optional: bool = False
    """The code checks that it exists and falls back without it (``why`` says to what)."""
    checked: str = ""
    """The releases it was checked on, where not its package's ``CHECKED_ON``."""
    why: str

    @property
    def path(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"

    @property
    def checked_on(self) -> str:
        package = package_of(self)
        return self.checked or f"{package} {CHECKED_ON[package]}"


@dataclass(frozen=True, kw_only=True)
class Function(_Name):
    """A method or function of theirs we override, call, or receive calls of."""

    params: tuple[str, ...] = ()
    """The parameters we pass positionally (or receive, for an override), in order, without
    ``self``."""
    keywords: tuple[str, ...] = ()
    """The parameters we pass by name."""
    passes_through: bool = False
    """An override taking ``*args, **kwargs`` and passing them on: only the name matters."""


@dataclass(frozen=True, kw_only=True)
class Attribute(_Name):
    """An attribute of theirs: a module or class attribute (``on_class``), or one their code
    sets or reads on instances, which is then found in the owner module's source."""

    on_class: bool = True


Entry = Function | Attribute


def package_of(entry: _Name) -> str:
    top = entry.owner.split(".")[0].split(":")[0]
    return "lightning" if top in ("pytorch_lightning", "lightning_fabric") else top


def owner_of(entry: Entry) -> Any:
    """The module, class or object ``entry`` belongs to, importing its module."""
    module_name, _, attributes = entry.owner.partition(":")
    owner: Any = importlib.import_module(module_name)
    for attribute in attributes.split(".") if attributes else ():
        owner = getattr(owner, attribute)
    return owner


def loaded(entry: Attribute) -> Any:
    """``entry``'s value if its module is loaded already, else None (never imports it)."""
    module_name, _, attributes = entry.owner.partition(":")
    owner = sys.modules.get(module_name)
    for attribute in attributes.split(".") if attributes else ():
        owner = getattr(owner, attribute, None)
    return getattr(owner, entry.name, None)


C10D = "torch.distributed.distributed_c10d"
PROCESS_GROUP = "torch.distributed:ProcessGroup"
MODULE = "torch.nn:Module"
TENSOR = "torch:Tensor"
STORAGE = "torch:UntypedStorage"
OPTIMIZER = "torch.optim:Optimizer"

# ---------------------------------------------------------------- torch.distributed
DISTRIBUTED = (
    Function(owner=C10D, name="_get_default_store",
             why="comm/collectives.py: the rendezvous store carries agreements and failure "
                 "reports, because it still answers while the group holds an unmatched op"),
    Function(owner=C10D, name="_get_default_group",
             why="comm/collectives.py: whether new groups split the world's communicator "
                 "(a default group bound to a device), torch's own test"),
    Function(owner=PROCESS_GROUP, name="_reduce_scatter_base", optional=True,
             why="comm/collectives.py: gloo's reduce-scatter ignores wait(timeout), so with a "
                 "wait timeout the op is issued with the timeout in its options; without "
                 "it, the public reduce_scatter_tensor (the group's own timeout)"),
    Function(owner=PROCESS_GROUP, name="_get_backend", optional=True,
             why="comm/collectives.py group_timeout: the group's timeout is kept only in its "
                 "backend's options; without it the timeout is reported unknown (None)"),
    Attribute(owner="torch.distributed:ProcessGroupGloo.Options", name="_timeout",
              optional=True,
              why="comm/collectives.py group_timeout: the seconds the group was created "
                  "with; without it the timeout is reported unknown (None)"),
    Attribute(owner="torch.distributed.checkpoint.filesystem", name="_StorageInfo",
              why="checkpoint/pickles.py, convert.py: DCP's .metadata pickles name it; the "
                  "restricted unpickler must allow it to read a DCP checkpoint"),
    Function(owner="torch.serialization", name="_get_layout",
             why="checkpoint/pickles.py: torch's pickles name it for tensor layouts; the "
                 "restricted unpickler allows it"),
)

# ---------------------------------------------------------------- torch core
CORE = (
    Attribute(owner="torch", name="_dynamo",
              why="core/eager.py: imported only once something compiles, to exclude the "
                  "gathers from traced graphs"),
    Function(owner="torch._dynamo", name="disable",
             why="core/eager.py: recursive=True, which torch.compiler.disable also takes, but "
                 "this one is reached without importing dynamo before it is needed"),
    Function(owner="torch.utils._pytree", name="tree_flatten",
             why="core/autograd.py, core/runtime.py: the tensors in a module's output, at any "
                 "nesting, as torch's own hooks find them"),
    Function(owner="torch.utils._pytree", name="tree_unflatten",
             why="core/autograd.py: the output rebuilt around tensors that carry the hooks"),
    Function(owner="torch.utils._pytree", name="tree_map",
             why="core/precision.py: inputs cast to the compute dtype at any nesting; "
                 "integrations/hf/hub_layout.py: traced tensors through any op's output"),
    Function(owner="torch", name="_foreach_norm",
             why="core/grads.py: every gradient's max-abs in one multi-tensor pass"),
    Function(owner="torch.autograd:Variable._execution_engine", name="queue_callback",
             why="core/autograd.py: run once the current backward pass has finished "
                 "(FSDP's way to finish a step's reductions)"),
    Function(owner=TENSOR, name="_make_subclass",
             why="integrations/hf/hub_layout.py: meta tensors that record their sources, to "
                 "plan transformers' reverse weight conversions on shapes alone"),
    Attribute(owner="torch._C", name="DisableTorchFunctionSubclass",
              why="integrations/hf/hub_layout.py: run the op itself inside __torch_function__"),
    Function(owner="torch._C", name="_storage_Use_Count", optional=True,
             why="core/storage.py: how many tensors share a storage, to catch a gathered "
                 "tensor kept past its release; without it the check is skipped"),
    Function(owner=STORAGE, name="_swap_data_ptr_", optional=True,
             why="core/storage.py: the buffer pool lends host memory without replacing the "
                 "storage autograd's saved tensors alias; without it storages are resized"),
    Attribute(owner=STORAGE, name="_cdata",
              why="core/storage.py: the storage handle _storage_Use_Count takes"),
    Attribute(owner=TENSOR, name="_base",
              why="core/activations.py, core/materialize.py: the tensor a view was taken of "
                  "(offloading saves the parameter once; a write through a view)"),
    Function(owner=TENSOR, name="_is_view",
             why="core/grads.py: a gradient is adopted as the bucket's storage only when "
                 "it owns its memory"),
    Attribute(owner=TENSOR, name="_version",
              why="core/activations.py: an offloaded activation changed in place after it "
                  "was saved is refused, as autograd refuses it"),
)

# ---------------------------------------------------------------- torch.nn / torch.optim
MODULES = (
    Attribute(owner=MODULE, name="_parameters", on_class=False,
              why="core/access.py, core/materialize.py, integrations/hf/pretrained.py: a "
                  "module's own parameters, read and replaced without recursion or hooks"),
    Attribute(owner=MODULE, name="_buffers", on_class=False,
              why="core/materialize.py, integrations/hf/pretrained.py: as _parameters, for "
                  "buffers"),
    Function(owner=MODULE, name="_apply", params=("fn", "recurse"),
             why="core/hooks.py: overridden on the swapped module classes, so .to/.half on "
                 "a managed module is refused by name instead of breaking the shards"),
    Function(owner=MODULE, name="_load_from_state_dict",
             params=("state_dict", "prefix", "local_metadata", "strict", "missing_keys",
                     "unexpected_keys", "error_msgs"),
             why="core/hooks.py: overridden, load_state_dict writes into the shards"),
    Function(owner=MODULE, name="_save_to_state_dict",
             params=("destination", "prefix", "keep_vars"),
             why="core/hooks.py: overridden, state_dict of a sharded module is checked"),
    Function(owner="torch.nn:MultiheadAttention", name="_reset_parameters",
             why="core/materialize.py: how MultiheadAttention and Transformer initialise, "
                 "replayed when a meta model is built on the device"),
    Function(owner=OPTIMIZER, name="_patch_step_function",
             why="optim/combined.py: CombinedOptimizer skips Optimizer.__init__ (its groups "
                 "are a live view of its parts') and sets up what step hooks need itself"),
    Attribute(owner="torch.optim.lr_scheduler", name="_opt_called", on_class=False,
              why="engine/step.py: set on the user's optimizers when the engine steps for "
                  "them, so their LR schedulers do not warn that step() was skipped"),
)
"""``CombinedOptimizer`` also sets the hook tables ``Optimizer.__init__`` would
(``OPTIMIZER_STATE``)."""

OPTIMIZER_STATE = tuple(
    Attribute(owner=OPTIMIZER, name=f"_optimizer_{kind}_hooks", on_class=False,
              why="optim/combined.py: the hook tables Optimizer.__init__ would have set")
    for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                 "load_state_dict_pre", "load_state_dict_post"))

# ---------------------------------------------------------------- Lightning
PL_SCRIPT = "lightning.pytorch.strategies.launchers.subprocess_script"
FABRIC_SCRIPT = "lightning.fabric.strategies.launchers.subprocess_script"
LIGHTNING = (
    Attribute(owner=PL_SCRIPT, name="_SubprocessScriptLauncher",
              why="integrations/lightning.py: the launcher ours extends to run Hydra jobs"),
    Attribute(owner=FABRIC_SCRIPT, name="_SubprocessScriptLauncher",
              why="integrations/fabric.py: the same for Fabric"),
    Function(owner=f"{PL_SCRIPT}:_SubprocessScriptLauncher", name="_call_children_scripts",
             why="integrations/hydra_launch.py: overridden, the children get Hydra's job"),
    Function(owner=f"{PL_SCRIPT}:_SubprocessScriptLauncher", name="_check_can_spawn_children",
             why="integrations/hydra_launch.py: Lightning's own check before spawning"),
    Attribute(owner="lightning.fabric.strategies.strategy", name="_BackwardSyncControl",
              why="integrations/fabric.py: no_backward_sync mapped onto the engine's"),
    Attribute(owner="lightning.fabric.utilities.types", name="_PATH",
              why="integrations/lightning.py, fabric.py: the checkpoint path type of the "
                  "signatures we override"),
    Function(owner="lightning.pytorch.core.optimizer", name="_configure_optimizers",
             why="integrations/lightning.py: the optimizers configure_optimizers() returns, "
                 "parsed as Lightning parses them"),
    Function(owner="lightning.pytorch.core.optimizer", name="_validate_optimizers_attached",
             why="integrations/lightning.py: wrapped while the strategy sets up, to accept "
                 "the engine's optimizer in place of the user's"),
    Attribute(owner="lightning.pytorch.core.saving", name="_default_map_location",
              why="integrations/lightning.py: Lightning's default map_location, under which "
                  "a consolidated checkpoint stays on the CPU"),
    Function(owner="lightning.pytorch.plugins.precision:Precision", name="_after_closure",
             params=("model", "optimizer"),
             why="integrations/lightning.py: the hooks and clipping after the closure, called "
                 "as Lightning's own optimizer_step does"),
    Function(owner="lightning.fabric.strategies:Strategy", name="_err_msg_joint_setup_required",
             why="integrations/fabric.py: Fabric's own message for an optimizer set up alone"),
    Function(owner="lightning.pytorch.strategies:DDPStrategy", name="_configure_launcher",
             why="integrations/lightning.py: overridden, the launcher is ours (Hydra jobs)"),
    Function(owner="lightning.fabric.strategies:DDPStrategy", name="_configure_launcher",
             why="integrations/fabric.py: overridden, the launcher is ours (Hydra jobs)"),
    Attribute(owner="lightning.pytorch.strategies.strategy", name="_launcher", on_class=False,
              why="integrations/lightning.py: where _configure_launcher puts the launcher"),
    Attribute(owner="lightning.pytorch.strategies.strategy", name="_precision_plugin",
              on_class=False,
              why="integrations/lightning.py: the strategy's precision plugin, ours (the "
                  "engine does the casting and the loss scaling)"),
    Attribute(owner="lightning.fabric.strategies.strategy", name="_launcher", on_class=False,
              why="integrations/fabric.py: where _configure_launcher puts the launcher"),
    Attribute(owner="lightning.fabric.strategies.strategy", name="_precision", on_class=False,
              why="integrations/fabric.py: the strategy's precision plugin, ours"),
    Attribute(owner="lightning.fabric.strategies.strategy", name="_backward_sync_control",
              on_class=False,
              why="integrations/fabric.py: no_backward_sync() goes to the engine's no_sync"),
)

# ---------------------------------------------------------------- PEFT
PEFT = (
    Function(owner="peft:PeftModel", name="_get_base_model_class", keywords=("is_prompt_tuning",),
             why="integrations/hf/peft_layout.py: adapter_config.json's auto_mapping, as "
                 "PeftModel.save_pretrained writes it"),
)

OWN_MARKERS = {
    "_zero_strategy": "integrations/lightning.py: set on our wrapper of Lightning's pl_load, "
                      "so the wrapper is installed once",
}
"""Private names we set on objects of ours that stand in for theirs: not theirs to pin."""

ALL: tuple[Entry, ...] = (*DISTRIBUTED, *CORE, *MODULES, *OPTIMIZER_STATE, *LIGHTNING, *PEFT)
"""Every entry above; ``integrations/hf/compat.ALL`` has transformers' and Accelerate's."""
