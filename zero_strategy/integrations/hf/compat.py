"""Every private (or internal, undocumented) name of transformers and Accelerate the adapters
rely on, with the parameters we call or override it with.

An override of a private method that transformers renames is never called again, and nothing
fails: the Trainer would save one rank's shard as the model. So each name we rely on is listed
here, declaratively, and ``tests/quick/test_hf_compat.py`` asserts that each exists in the
installed versions with a signature we can call (our parameters by name, in our order; any
others optional); it also fails on a private override missing from these lists, and
``tests/quick/test_private_names.py`` on a private name of theirs used anywhere in
``zero_strategy/`` that no list has. The adapters read the names they swap, set or look up
from here, so the list is what the code uses, not a copy of it. The entry types, and torch's,
Lightning's and PEFT's names, are in ``zero_strategy/compat.py``: the two make the registry.

Importing this module imports no framework: names are strings, resolved on demand.
"""

from __future__ import annotations

from ...compat import Attribute, Entry, Function, loaded, owner_of

__all__ = ["Attribute", "Entry", "Function", "loaded", "owner_of"]


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
    why="set on the model at stage 3 with several ranks: generate() then runs synced_gpus")

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
             params=("input_dict", "source_patterns", "target_patterns"),
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

ALL: tuple[Function | Attribute, ...] = (
    *TRAINER_OVERRIDES, *TRAINER_HOOKS, *TRAINER_CALLS, TRAINER_ACCELERATOR, FSDP_MANAGED,
    ACCELERATOR_MODELS, ACCELERATOR_OPTIMIZERS, ACCELERATOR_SCHEDULERS,
    ACCELERATOR_DATALOADERS, *ACCELERATE_ADAPTER, CHECKPOINTING_LAYER, CHECKPOINTING_FUNCTION,
    *PRETRAINED_NAMES, *SAVE_NAMES,
)
"""Every name above, for the test."""
