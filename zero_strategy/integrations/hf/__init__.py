"""The Hugging Face side of the adapters: ``transformers.Trainer`` (and TRL's and PEFT's use of
it) in ``trainer.py``, what TRL's trainers need beyond it (their reference loaded streamed,
``sync_ref_model`` through the engines) in ``trl.py``, ``from_pretrained`` streaming into
shards in ``pretrained.py``, and transformers' checkpointable layers for the engine's activation
checkpointing in ``activations.py``. Every private name of transformers, Accelerate and PEFT
these modules rely on is listed in ``zero_strategy/compat.py``, each pinned by
``tests/quick/test_compat.py``.

Importing this package imports no framework: ``activations.py`` is registered from
``zero_strategy/__init__`` for every user, and looks for transformers only among the modules
already loaded (``trl.py`` looks for TRL so); ``trainer.py`` and ``pretrained.py`` import
transformers and are reached through ``zero_strategy.transformers``."""
