"""Accelerate integration: an ordinary ``accelerate launch`` training loop trained by ZeroEngine.

Accelerate has no extension point for a third-party sharding backend (``DistributedType`` is a
closed enum, the config loader rejects unknown keys, ``kwargs_handlers`` takes fixed classes), so
``ZeroAccelerator`` subclasses ``Accelerator`` and reroutes only what touches the model and its
optimizer; data loaders, schedulers, ``accumulate()``, RNG/sampler checkpointing, logging and
process control stay Accelerate's own::

    from zero_strategy.accelerate import ZeroAccelerator, ZeroPlugin

    accelerator = ZeroAccelerator(gradient_accumulation_steps=2)  # $ZERO_STRATEGY_CONFIG
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):       # no communication on non-final micro-batches
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)   # global norm over shards
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")                # sharded; every rank calls it
    state = accelerator.get_state_dict(model)     # consolidated fp32, the user's keys

Several optimizers over disjoint parameter sets (Muon for the hidden matrices, AdamW for the
rest) train one engine: ``model, muon, adamw, sched = accelerator.prepare(model, muon, adamw,
sched)``. The first ``.step()`` of any of them after a backward steps them all (one ZeRO step);
each other one's ``.step()`` then only takes its turn; schedulers prepared per part work.

Launch (CPU with gloo, or GPUs with nccl; the accelerate config is an ordinary multi-process one)::

    ZERO_STRATEGY_CONFIG=conf/accelerate/zero3.yaml \\
        accelerate launch --config_file conf/accelerate/multi_process.yaml train.py

Where the ZeRO options come from, highest precedence first:

1. keyword arguments in code: ``ZeroPlugin(stage=2, ...)`` or ``ZeroPlugin.from_config(path,
   stage=2)``;
2. the plugin config file, a YAML mapping of ``ZeroConfig`` fields: the ``path`` given to
   ``ZeroPlugin.from_config``, else the file named by ``$ZERO_STRATEGY_CONFIG``. (It cannot be
   named inside the accelerate config: Accelerate rejects unknown top-level keys and passes
   nothing of that file to the launched processes except the variables it knows.);
3. ``ZeroConfig``'s defaults.

``ZeroAccelerator(zero_plugin=None)`` means ``ZeroPlugin.from_config()``. Precision: a
``precision`` set by (1) or (2) wins; otherwise it follows Accelerate's ``mixed_precision``
(``Accelerator(mixed_precision=...)``, else the launch config / ``--mixed_precision``): ``no`` ->
``32-true``, ``bf16`` -> ``bf16-autocast``, ``fp16`` -> ``16-autocast``: what Accelerate
itself runs, autocast over fp32 weights (the plugin may choose the compute copies,
``bf16-mixed``/``16-mixed``, or ``bf16-true`` instead). An explicit precision that contradicts
a non-``no`` mixed_precision is an error. The engine applies the autocast (around the model's
forward, as Accelerate does) and the fp16 loss scaling (``LossScaleConfig``, by default with
``GradScaler``'s knobs when the precision comes from ``mixed_precision``); Accelerate's own
autocast and ``GradScaler`` are never switched on.

A bad plugin config (unknown key, wrong type, invalid value) raises ``ConfigError`` (a
``ValueError``) naming the key and the file when the plugin is built, before any process group,
model or data exists; ``ZeroConfig.from_options`` checks it, with the words every other entry
point uses.

Differences from plain Accelerate, all because the state is sharded:

- ``clip_grad_norm_`` on a micro-batch that does not synchronise returns None and clips nothing
  (DDP would clip the local partial gradient); guard it with ``if accelerator.sync_gradients``.
- ``get_state_dict``, ``save_model``, ``save_state``, ``load_state`` and the prepared model's
  ``state_dict()`` are collectives: call them on every rank. So are ``optimizer.state_dict()``
  (the whole state in torch's format) and ``load_state_dict()`` of the model and optimizer;
  ``save_state``/``load_state`` keep the state sharded.
- ``save_state`` writes Accelerate's own files (schedulers, samplers, RNG per rank, step,
  registered objects) and the engine's sharded checkpoint in ``zero_checkpoint/``, then waits
  for every rank. The engine part loads on any world size and stage.
- One ZeRO model per accelerator, prepared together with its optimizer(s); other models (e.g.
  a frozen teacher) get Accelerate's usual preparation. Accelerate's dynamo settings are not
  applied to the ZeRO model.

Not about sharding: ``skip_first_batches`` returns a loader whose iterator does not draw from
the global torch generator, so a mid-epoch resume repeats the uninterrupted run's dropout masks
(plain Accelerate's draws once after ``load_state`` restored the generator).

The package: ``plugin.py`` (``ZeroPlugin`` and its files), ``accelerator.py``
(``ZeroAccelerator`` and the wrappers its ``prepare`` returns), ``state.py`` (Accelerate's state
folder: the checks before ``load_state`` reads it).
"""

from .accelerator import ZeroAccelerator, ZeroModel, ZeroOptimizer, has_accelerator_device
from .plugin import COMPATIBLE_PRECISIONS, CONFIG_ENV, ZeroPlugin, read_plugin_file
from .state import CHECKPOINT_SUBDIR, CHECKPOINT_TAG

__all__ = [
    "CHECKPOINT_SUBDIR", "CHECKPOINT_TAG", "COMPATIBLE_PRECISIONS", "CONFIG_ENV", "ZeroAccelerator",
    "ZeroModel", "ZeroOptimizer", "ZeroPlugin", "has_accelerator_device", "read_plugin_file",
]
