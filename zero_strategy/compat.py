"""Every private (or internal, undocumented) name of torch, Lightning, Accelerate,
transformers and PEFT the package touches, each with why it is needed.

A private name can change in any release without notice. An override of a private method
that transformers renames is never called again, and nothing fails: the Trainer would save
one rank's shard as the model; a private torch function that moves changes what a collective
or a hook does. So each name is listed here, declaratively, and ``tests/quick/test_compat.py``
asserts that each exists in the installed versions (a method or function with a signature we
can call: our parameters by name, in our order; any others optional), and fails on a private
name of theirs used anywhere in ``zero_strategy/`` that is missing from these lists (imports,
attribute reads and writes, names given to ``getattr``/``setattr``/``hasattr`` as strings,
and overrides in our subclasses of their classes). The adapters read the names they swap,
set or look up from here, so the list is what the code uses, not a copy of it.

Importing this module imports no framework: names are strings, resolved on demand. It sits
at the bottom of the layers (beside ``config.py``), so any module may read it.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Function:
    """A method or function of theirs we override, call, or receive calls of."""

    owner: str
    """``"package.module"`` (a function) or ``"package.module:Class"`` (a method)."""
    name: str
    params: tuple[str, ...] = ()
    """The parameters we pass positionally (or receive, for an override), in order, without
    ``self``."""
    keywords: tuple[str, ...] = ()
    """The parameters we pass by name."""
    passes_through: bool = False
    """An override taking ``*args, **kwargs`` and passing them on: only the name matters."""
    since: str = ""
    until: str = ""
    """The releases of the owner's package that have it, ``since`` included, ``until`` not,
    where they lie inside the range we support: outside them the code never meets it."""
    why: str


@dataclass(frozen=True, kw_only=True)
class Attribute:
    """An attribute of theirs: a module or class attribute (``on_class``), or one their code
    sets or reads on instances, which is then found in the owner module's source."""

    owner: str
    name: str
    on_class: bool = True
    since: str = ""
    until: str = ""
    """As ``Function``'s."""
    why: str


@dataclass(frozen=True, kw_only=True)
class Module:
    """A private module of theirs (``owner.name``), and the names we use from it."""

    owner: str
    name: str
    uses: tuple[str, ...] = ()
    why: str


@dataclass(frozen=True, kw_only=True)
class NotTheirs:
    """A name that looks private to the scan and is not a framework's: one of ours that we
    set on their objects (so it must never become one of theirs), or a fragment of theirs
    matched in public names."""

    name: str
    why: str


# ---------------------------------------------------------------- torch
STORAGE_SWAP = Attribute(
    owner="torch:UntypedStorage", name="_swap_data_ptr_", since="2.12.0",
    why="core/storage.py: the buffer pool lends memory to a stage-3 unit without replacing "
        "the storage autograd's saved tensors alias (host memory); torch 2.9-2.11 lack it, "
        "and there the pool resizes the unit's storage, as it does on a GPU")

TORCH = (
    Module(owner="torch.utils", name="_pytree", uses=("tree_flatten", "tree_unflatten",
                                                       "tree_map"),
           why="a module's nested inputs and outputs walked as torch's own hooks walk them "
               "(tensors in tuples, dicts, dataclasses, registered nodes); torch ships no "
               "public pytree module"),
    Module(owner="torch", name="_dynamo", uses=("disable",),
           why="core/eager.py: gathers and frees kept out of compiled graphs, and dynamo "
               "imported only once something compiles (a 2.4 s import otherwise)"),
    Module(owner="torch", name="_C", uses=("DisableTorchFunctionSubclass",),
           why="integrations/hf/hub_layout.py: a traced tensor runs the op itself without "
               "recursing into its own __torch_function__"),
    Attribute(owner="torch._C", name="_storage_Use_Count",
              why="core/storage.py: how many tensors share a storage (optional: the check it "
                  "serves is skipped on a torch without it)"),
    STORAGE_SWAP,
    Attribute(owner="torch:UntypedStorage", name="_cdata",
              why="core/storage.py: the storage handle _storage_Use_Count takes"),
    Attribute(owner="torch:Tensor", name="_base",
              why="the tensor a view was made from: activation packing and sharded init "
                  "find the storage's owner through it"),
    Attribute(owner="torch:Tensor", name="_is_view",
              why="core/grads.py: a gradient adopted as the unit's buffer must not be a view"),
    Attribute(owner="torch:Tensor", name="_make_subclass",
              why="integrations/hf/hub_layout.py: meta tensors traced through transformers' "
                  "reverse conversions"),
    Attribute(owner="torch", name="_foreach_norm",
              why="core/grads.py: every gradient's max-abs in one multi-tensor pass"),
    Attribute(owner="torch.autograd:Variable", name="_execution_engine",
              why="core/autograd.py: queue_callback runs the runtime's end of backward once "
                  "autograd has finished (as DDP and FSDP do)"),
    Attribute(owner="torch.nn:Module", name="_parameters", on_class=False,
              why="a module's own parameters, read and replaced in place (state dict "
                  "loading, sharded init, pretrained loading) without its __setattr__"),
    Attribute(owner="torch.nn:Module", name="_buffers", on_class=False,
              why="a module's own buffers, read and replaced in place as _parameters are "
                  "(sharded init, pretrained loading)"),
    Function(owner="torch.nn:Module", name="_apply", params=("fn", "recurse"),
             why="core/hooks.py: overridden on the swapped module classes, so .to(), .half() "
                 "and to_empty() on a managed module are checked before torch moves anything"),
    Function(owner="torch.nn:Module", name="_load_from_state_dict",
             params=("state_dict", "prefix", "local_metadata", "strict", "missing_keys",
                     "unexpected_keys", "error_msgs"),
             why="core/hooks.py: overridden, load_state_dict writes managed parameters into "
                 "their masters and shards"),
    Function(owner="torch.nn:Module", name="_save_to_state_dict",
             params=("destination", "prefix", "keep_vars"),
             why="core/hooks.py: overridden, state_dict of a module whose parameters may be "
                 "sharded is checked first"),
    Attribute(owner="torch:Tensor", name="_version",
              why="core/activations.py: an offloaded activation changed in place after it "
                  "was saved is refused, as autograd refuses it"),
    Attribute(owner="torch.nn:MultiheadAttention", name="_reset_parameters",
              why="core/materialize.py: the init a LATE_INIT module's constructor runs (it "
                  "has no reset_parameters)"),
    Attribute(owner="torch.nn:Transformer", name="_reset_parameters",
              why="core/materialize.py: as MultiheadAttention's"),
    Attribute(owner="torch.optim:Optimizer", name="_patch_step_function",
              why="optim/combined.py: CombinedOptimizer gets torch's step hooks without "
                  "Optimizer.__init__ (it owns no parameters itself)"),
    *(Attribute(owner="torch.optim:Optimizer", name=f"_optimizer_{hook}_hooks", on_class=False,
                why="optim/combined.py: the hook tables Optimizer.__init__ would make, made "
                    "by CombinedOptimizer itself")
      for hook in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                   "load_state_dict_pre", "load_state_dict_post")),
    Attribute(owner="torch.optim.lr_scheduler", name="_opt_called", on_class=False,
              why="engine/step.py: set on the user's optimizers at each step, which the "
                  "engine steps through its inner copy, so their LR schedulers do not warn "
                  "that the optimizer was never stepped"),
    Attribute(owner="torch.serialization", name="_get_layout",
              why="checkpoint/pickles.py: allowed when unpickling DCP's metadata, which "
                  "names it for every tensor's layout"),
    Attribute(owner="torch.distributed.checkpoint.filesystem", name="_StorageInfo",
              why="checkpoint/pickles.py and convert.py: DCP's record of where an item's "
                  "bytes lie, read from and written into .metadata"),
    Attribute(owner="torch.distributed.checkpoint.metadata", name="_MEM_FORMAT_ENCODING",
              why="checkpoint/pickles.py: allowed when unpickling DCP's metadata (looked up "
                  "only where this torch has it)"),
    Attribute(owner="torch.distributed.distributed_c10d", name="_get_default_store",
              why="comm/groups.py: the rendezvous store, which answers while a group "
                  "holds unmatched operations (failure reports, agreements)"),
    Attribute(owner="torch.distributed.distributed_c10d", name="_get_default_group",
              why="comm/groups.py: whether groups are split from a bound default group; "
                  "comm/collectives.py: the key of the side channel made once per group"),
    Attribute(owner="torch.distributed:ProcessGroup", name="_get_backend",
              why="comm/groups.py: the backend whose options hold the group's timeout"),
    Attribute(owner="torch.distributed:ProcessGroupGloo.Options", name="_timeout",
              why="comm/groups.py: the timeout a group was created with (NCCL's options "
                  "have the same name)"),
    Attribute(owner="torch.distributed:ProcessGroup", name="_reduce_scatter_base",
              why="comm/collectives.py: gloo's reduce-scatter with the timeout in its options "
                  "(its work ignores wait(timeout))"),
    Attribute(owner="torch.autograd", name="_profiler_enabled",
              why="comm/collectives.py: whether a profiler runs, so point-to-point works "
                  "start unrecorded (a record ending after the profiler stopped corrupts it)"),
    Attribute(owner="torch.autograd", name="_enable_record_function",
              why="comm/collectives.py: the thread's record functions off while a "
                  "point-to-point work starts under a profiler"),
)

# ---------------------------------------------------------------- Lightning
FABRIC_LAUNCHER = (
    "lightning.fabric.strategies.launchers.subprocess_script:_SubprocessScriptLauncher")
TRAINER_LAUNCHER = (
    "lightning.pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher")

LIGHTNING = (
    *(entry for launcher in (FABRIC_LAUNCHER, TRAINER_LAUNCHER) for entry in (
        Attribute(owner=launcher.partition(":")[0], name="_SubprocessScriptLauncher",
                  why="the launcher of local ranks, subclassed to run one Hydra job per "
                      "world (integrations/hydra_launch.py)"),
        Function(owner=launcher, name="_call_children_scripts",
                 why="overridden: each child gets the job's resolved overrides"),
        Function(owner=launcher, name="_check_can_spawn_children",
                 why="called first, as Lightning's own _call_children_scripts does"),
    )),
    Attribute(owner="lightning.fabric.strategies.strategy", name="_BackwardSyncControl",
              why="subclassed: fabric.no_backward_sync is engine.no_sync()"),
    Attribute(owner="lightning.fabric.utilities.types", name="_PATH",
              why="the path type of the strategies' checkpoint methods we override"),
    Attribute(owner="lightning.fabric.strategies:DDPStrategy", name="_backward_sync_control",
              on_class=False, why="set to ours by ZeroFabricStrategy"),
    Function(owner="lightning.fabric.strategies:DDPStrategy", name="_configure_launcher",
             why="overridden: the Hydra-aware launcher"),
    Attribute(owner="lightning.fabric.strategies:DDPStrategy", name="_launcher",
              on_class=False, why="set by our _configure_launcher, as DDPStrategy's does"),
    Function(owner="lightning.fabric.strategies:DDPStrategy",
             name="_err_msg_joint_setup_required",
             why="Fabric's own message when an optimizer is set up without its model"),
    Attribute(owner="lightning.fabric.strategies:Strategy", name="_precision", on_class=False,
              why="the strategy's precision plugin, ours by default"),
    Function(owner="lightning.pytorch.strategies:DDPStrategy", name="_configure_launcher",
             why="overridden: the Hydra-aware launcher"),
    Attribute(owner="lightning.pytorch.strategies:DDPStrategy", name="_launcher",
              on_class=False, why="set by our _configure_launcher, as DDPStrategy's does"),
    Attribute(owner="lightning.pytorch.strategies:Strategy", name="_precision_plugin",
              on_class=False, why="the strategy's precision plugin, ours by default"),
    Function(owner="lightning.pytorch.plugins.precision:Precision", name="_after_closure",
             params=("model", "optimizer"),
             why="on_before_optimizer_step hooks and clipping, run by our optimizer_step"),
    Function(owner="lightning.pytorch.core.optimizer", name="_configure_optimizers",
             params=("optim_conf",),
             why="how many optimizers configure_optimizers returns, asked before launch"),
    Function(owner="lightning.pytorch.core.optimizer", name="_validate_optimizers_attached",
             params=("optimizers", "lr_scheduler_configs"),
             why="wrapped while Lightning sets optimizers up, so a scheduler on a part of a "
                 "CombinedOptimizer is accepted"),
    Attribute(owner="lightning.pytorch.core.saving", name="_default_map_location",
              why="load_from_checkpoint's default map_location: the weights stay on the CPU"),
    Function(owner="lightning.pytorch.callbacks:ModelCheckpoint", name="_save_checkpoint",
             params=("trainer", "filepath"),
             why="overridden by integrations/ray/lightning.py's RayModelCheckpoint: every file "
                 "ModelCheckpoint saves, whatever its options, reported to Ray once written"),
)

# ---------------------------------------------------------------- PEFT
PEFT = (
    Function(owner="peft:PeftModel", name="_get_base_model_class",
             keywords=("is_prompt_tuning",),
             why="integrations/hf/peft_layout.py: adapter_config.json's auto_mapping, as "
                 "PeftModel.save_pretrained writes it"),
)

TRAINER = "transformers.trainer:Trainer"
ACCELERATOR = "accelerate.accelerator:Accelerator"
PRETRAINED = "transformers.modeling_utils:PreTrainedModel"

# ---------------------------------------------------------------- transformers.Trainer
TRAINER_OVERRIDES = (
    Function(owner=TRAINER, name="_move_model_to_device", params=("model", "device"),
             why="the engine places the shards; a meta model must not be moved whole"),
    Function(owner=TRAINER, name="_prepare_for_training",
             params=("max_steps", "train_dataloader", "resume_from_checkpoint"),
             why="where the engine exists first: stage 3's synced generate is set there"),
    Function(owner=TRAINER, name="_save_optimizer_and_scheduler", params=("output_dir",),
             why="the sharded optimizer goes to zero_checkpoint/"),
    Function(owner=TRAINER, name="_save_scaler", params=("output_dir",),
             why="fp16 loss scaling is the engine's"),
    Function(owner=TRAINER, name="_load_from_checkpoint",
             params=("resume_from_checkpoint", "model"),
             why="a checkpoint with a sharded copy is read after prepare, not into the model"),
    Function(owner=TRAINER, name="_load_optimizer_and_scheduler", params=("checkpoint",),
             why="the sharded optimizer is read from zero_checkpoint/"),
    Function(owner=TRAINER, name="_load_scaler", params=("checkpoint",),
             why="fp16 loss scaling is the engine's"),
    Function(owner=TRAINER, name="_load_best_model",
             why="the best checkpoint's exact masters, from its sharded copy"),
    Function(owner=TRAINER, name="_save", params=("output_dir", "state_dict"),
             why="without a state dict, the weights stream from the shards"),
)
"""Trainer's private methods ``ZeroTrainerMixin`` overrides (every one of them)."""

TRAINER_HOOKS = (
    Function(owner=TRAINER, name="create_accelerator_and_postprocess",
             why="builds the accelerator (a ZeroAccelerator, by TRAINER_ACCELERATOR)"),
    Function(owner=TRAINER, name="create_optimizer", params=("model",),
             why="stage 3 adds the frozen parameters to the optimizer"),
    Function(owner=TRAINER, name="save_model", params=("output_dir", "_internal_call"),
             why="consolidated weights; _internal_call is private"),
    Function(owner=TRAINER, name="evaluation_loop", passes_through=True,
             why="a meta model needs the engine before evaluate()/predict()"),
)
"""Undocumented public methods of Trainer we override (a private parameter among them)."""

TRAINER_CALLS = (
    Function(owner=TRAINER, name="_save", params=("output_dir",), keywords=("state_dict",),
             why="save_pretrained's files from the consolidated state dict"),
)

TRAINER_ACCELERATOR = Attribute(
    owner="transformers.trainer", name="Accelerator",
    why="the name create_accelerator_and_postprocess builds the accelerator by, swapped for "
        "that one call")

FSDP_MANAGED = Attribute(
    owner="transformers.distributed.fsdp", name="_is_fsdp_managed_module", on_class=False,
    since="5.14.0",
    why="set on the model at stage 3 with several ranks: generate() then runs synced_gpus")
FSDP_MANAGED_BEFORE = Attribute(
    owner="transformers.integrations.fsdp", name="_is_fsdp_managed_module", on_class=False,
    until="5.14.0", why="the same flag, read from here before transformers 5.14")

# ---------------------------------------------------------------- accelerate.Accelerator
ACCELERATOR_MODELS = Attribute(owner=ACCELERATOR, name="_models", on_class=False,
                               why="prepared models; free_memory keeps the engine's")
ACCELERATOR_OPTIMIZERS = Attribute(owner=ACCELERATOR, name="_optimizers", on_class=False,
                                   why="prepared optimizers; free_memory keeps the engine's")
ACCELERATOR_SCHEDULERS = Attribute(owner=ACCELERATOR, name="_schedulers", on_class=False,
                                   why="emptied by free_memory, as Accelerate's own does")
ACCELERATOR_DATALOADERS = Attribute(owner=ACCELERATOR, name="_dataloaders", on_class=False,
                                    why="emptied by free_memory, as Accelerate's own does")

ACCELERATE_ADAPTER = (
    Attribute(owner=ACCELERATOR, name="_custom_objects", on_class=False,
              why="integrations/accelerate: counts the custom states of a checkpoint"),
    Attribute(owner=ACCELERATOR, name="_is_accelerate_prepared", on_class=False,
              why="integrations/accelerate: flags the engine's wrappers as prepared"),
    Attribute(owner="accelerate.optimizer:AcceleratedOptimizer", name="_is_overflow",
              on_class=False, why="integrations/accelerate: a skipped fp16 step"),
)
"""Accelerate's private names ``integrations/accelerate`` relies on (pinned here, written
there)."""

# ---------------------------------------------------------------- activation checkpointing
CHECKPOINTING_LAYER = Attribute(
    owner="transformers.modeling_layers", name="GradientCheckpointingLayer",
    why="transformers' checkpointable layers, switched by the engine's activation policy")
CHECKPOINTING_FUNCTION = Attribute(
    owner="transformers.modeling_layers", name="_gradient_checkpointing_func", on_class=False,
    why="the checkpoint function a switched-on layer runs its forward with")

# ---------------------------------------------------------------- from_pretrained
DTYPE_PLAN = Function(owner=PRETRAINED, name="_get_dtype_plan", params=("dtype",),
                      why="modules kept in float32, which streaming refuses")
IGNORE_MISSING = Attribute(owner=PRETRAINED, name="_keys_to_ignore_on_load_missing",
                           why="keys the key map never reports missing")
IGNORE_UNEXPECTED = Attribute(owner=PRETRAINED, name="_keys_to_ignore_on_load_unexpected",
                              why="keys the key map never reports unexpected")
HF_INITIALIZED = Attribute(owner="transformers.initialization", name="_is_hf_initialized",
                           on_class=False,
                           why="flags the tensors the folder holds, which guarded inits skip")

PRETRAINED_NAMES = (
    DTYPE_PLAN, IGNORE_MISSING, IGNORE_UNEXPECTED, HF_INITIALIZED,
    Function(owner=PRETRAINED, name="_init_weights", params=("module",),
             why="initialises what the folder lacks"),
    *(Attribute(owner="transformers.modeling_utils", name=keyword, on_class=False,
                why="a private keyword from_pretrained takes (from the auto classes and "
                    "pipelines), accepted and ignored by ours as transformers ignores it")
      for keyword in ("_fast_init", "_from_auto", "_from_pipeline", "_commit_hash")),
    Attribute(owner="transformers.configuration_utils:PretrainedConfig",
              name="_attn_implementation", why="attn_implementation= set on the config"),
    Attribute(owner="transformers.configuration_utils:PretrainedConfig",
              name="_experts_implementation", why="experts_implementation= set on the config"),
    Function(owner="transformers.initialization", name="guard_torch_init_functions",
             why="makes torch's init functions honour _is_hf_initialized"),
    Function(owner="transformers.conversion_mapping", name="get_model_conversion_mapping",
             params=("model", "key_mapping", "hf_quantizer"),
             why="the model's legacy key renamings and weight converters"),
    Function(owner="transformers.core_model_loading", name="rename_source_key",
             params=("source_key", "weight_renamings", "weight_converters"),
             why="renames a folder key as transformers' loader does"),
    Attribute(owner="transformers.core_model_loading", name="WeightRenaming",
              why="a renaming among the conversion mapping's transforms"),
    Function(owner="transformers.core_model_loading:Conv3dToLinear",
             name="_get_target_pattern",
             params=("input_dict", "source_patterns", "target_patterns"), since="5.6.0",
             why="the target name a Conv3dToLinear (and its reverse) gives, replayed by the "
                 "streamed conversions"),
    Attribute(owner="transformers.core_model_loading", name="WeightConverter",
              why="a converter (tensors merged or split), replayed by the streamed conversions"),
    Function(owner="transformers.generation.utils:GenerationMixin",
             name="adjust_generation_fn",
             params=("generation_config", "from_auto_class", "from_pipeline",
                     "pretrained_model_name_or_path"),
             keywords=("cache_dir", "force_download", "proxies", "local_files_only", "token",
                       "revision", "subfolder", "trust_remote_code"),
             why="reads the folder's generation_config.json as from_pretrained does"),
)

IGNORED_ON_SAVE = Attribute(
    owner=PRETRAINED, name="_keys_to_ignore_on_save",
    why="keys save_pretrained leaves out; the streamed save leaves them out too")
TIED_WEIGHTS = Attribute(
    owner=PRETRAINED, name="_tied_weights_keys",
    why="which of two keys naming one tensor save_pretrained leaves out")
SAVE_NAMES = (IGNORED_ON_SAVE, TIED_WEIGHTS)
"""What ``hub_layout.py`` reads to write what ``save_pretrained`` writes."""

ALL: tuple[Function | Attribute | Module, ...] = (
    *TORCH, *LIGHTNING, *PEFT,
    *TRAINER_OVERRIDES, *TRAINER_HOOKS, *TRAINER_CALLS, TRAINER_ACCELERATOR, FSDP_MANAGED,
    FSDP_MANAGED_BEFORE,    ACCELERATOR_MODELS, ACCELERATOR_OPTIMIZERS, ACCELERATOR_SCHEDULERS,
    ACCELERATOR_DATALOADERS, *ACCELERATE_ADAPTER, CHECKPOINTING_LAYER, CHECKPOINTING_FUNCTION,
    *PRETRAINED_NAMES, *SAVE_NAMES,
)
"""Every name above, for the test."""

NOT_THEIRS = (
    NotTheirs(name="_zero_engine_slot",
              why="integrations/lightning.py: where a LightningModule keeps its engine"),
    NotTheirs(name="_zero_strategy",
              why="integrations/lightning.py: marks Lightning's pl_load as wrapped by us"),
    NotTheirs(name="_MAPPING_NAMES",
              why="checkpoint/hf.py: the suffix of transformers' public auto tables "
                  "(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, ...), matched with endswith"),
)
"""What the test's scan would take for a framework's private name, and why it is not."""


def owner_of(entry: Function | Attribute | Module) -> Any:
    """The module or class (``Class.Nested`` too) ``entry`` belongs to, importing its
    module."""
    module_name, _, class_name = entry.owner.partition(":")
    owner = importlib.import_module(module_name)
    for name in class_name.split(".") if class_name else ():
        owner = getattr(owner, name)
    return owner


def loaded(entry: Attribute) -> Any:
    """``entry``'s value if its module is loaded already, else None (never imports it)."""
    module_name, _, class_name = entry.owner.partition(":")
    owner = sys.modules.get(module_name)
    if owner is not None and class_name:
        owner = getattr(owner, class_name, None)
    return getattr(owner, entry.name, None)
