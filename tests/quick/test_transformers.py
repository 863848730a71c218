"""transformers.Trainer under ZeRO, its smallest end-to-end case: ``ZeroTrainer`` at stage 3 on
2 CPU processes against plain ``Trainer`` (DDP) with accumulation, clipping, a warm-up + cosine
schedule, evaluation, checkpoints, ``save_model`` and ``predict``; resuming from
``checkpoint-2``; and what is refused before training. Stages 1-2, offload, TRL + LoRA,
``generate`` and the rest: tests/integration/test_transformers_trainer.py."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from tests.support import trainer_checks as C


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return C.launch(tmp_path_factory.mktemp("trainer"),
                    ["fit_ddp", "fit_z3", "resume_z3", "ckpt_ddp", "ckpt_z3", "frozen_ddp",
                     "frozen_z3units"])


def test_zero3_trainer_matches_ddp_trainer(runs: dict) -> None:
    C.assert_matches_ddp(runs["fit_ddp"], runs["fit_z3"], "zero3")


def test_plugin_checkpointing_matches_trainer_gradient_checkpointing(runs: dict) -> None:
    """ZeroPlugin(activation_checkpointing=True, offload_activations="disk") against plain
    Trainer with gradient_checkpointing=True (non-reentrant): the same layers recomputed with
    the forward's dropout masks, so the same bound as without checkpointing."""
    C.assert_matches_ddp(runs["ckpt_ddp"], runs["ckpt_z3"], "zero3 checkpointed")
    assert runs["ckpt_ddp"]["hf_checkpointing"]  # the reference really recomputes
    # the engine's: both GPT-2 layers, their inputs (4 rows x 16 tokens x 32 wide) on disk
    assert runs["ckpt_z3"]["checkpointed"] == 2
    assert runs["ckpt_z3"]["offloaded"] == 2 * 4 * 16 * 32 * 4


def test_plugin_checkpointing_and_trainer_gradient_checkpointing_are_one_or_the_other(
        tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from tests.worlds.transformers_run import Tokens, tiny_gpt2
    from zero_strategy.transformers import ZeroPlugin, ZeroTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             gradient_checkpointing=True)
    with pytest.raises(ValueError, match="gradient_checkpointing=True.*keep one"):
        ZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(),
                    zero_plugin=ZeroPlugin(stage=3, activation_checkpointing=True))


@pytest.mark.parametrize("pattern", ["head", "first_block"])
def test_a_partial_fine_tune_keeps_no_frozen_unit_whole(runs: dict, pattern: str) -> None:
    """Issue 58: ZeroTrainer at stage 3 with only the final LayerNorm (and the first block)
    trained, every module its own unit. The losses are plain Trainer's (DDP) to 1e-5; and a
    frozen unit is never kept past its own backward: when the forward returns the root unit
    (the tied embedding, which the loss reads next) is whole, and from the second step the
    forward's last two units (``prefetch_units``) that backward crosses, which it needs
    first; when the first block's gradients arrive the frozen blocks behind them in backward
    are all freed again, and only units that train hold a gradient shard (a frozen one gets
    no gradient to reduce)."""
    ddp, zero = C.ok(runs["frozen_ddp"])[pattern], C.ok(runs["frozen_z3units"])[pattern]
    C.assert_close_lists(ddp["loss"], zero["loss"], f"{pattern}: loss")
    # head: backward crosses ln_f alone (nothing before it requires grad)
    kept = ["transformer.ln_f"] if pattern == "head" else [
        "transformer.h.1.mlp.c_proj", "transformer.ln_f"]
    assert zero["after_forward"] == [[""]] + [["", *kept]] * 2, zero["after_forward"]
    trained = ["transformer.ln_f"] + (
        [] if pattern == "head" else
        [f"transformer.h.0.{m}" for m in ("attn.c_attn", "attn.c_proj", "ln_1", "ln_2",
                                          "mlp.c_fc", "mlp.c_proj")])
    assert zero["grads"] == [sorted(trained)] * 3, zero["grads"]
    if pattern == "first_block":
        later = [n for names in zero["in_backward"] for n in names
                 if n.startswith("transformer.h.1.")]
        assert zero["in_backward"] and not later, zero["in_backward"]


def test_checkpoint_holds_trainer_files_and_the_sharded_state(runs: dict) -> None:
    C.assert_checkpoint_layout(C.ok(runs["fit_z3"])["run"])


def test_resume_from_checkpoint_equals_uninterrupted_run(runs: dict) -> None:
    C.assert_resume_equals_uninterrupted(runs["fit_z3"], runs["resume_z3"], "zero3")


def test_plain_trainer_on_cpu_is_really_distributed(runs: dict) -> None:
    """The reference must be a 2-process DDP run: without use_cpu=True Trainer silently runs
    one single process per rank on a machine without GPUs. Each rank sees half the rows, so
    an epoch of 32 rows in micro-batches of 4 with accumulation 2 is 2 optimizer steps."""
    assert C.ok(runs["fit_ddp"])["checkpoints"] == ["checkpoint-2", "checkpoint-4"]


def test_options_the_integration_replaces_are_refused_by_name(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from tests.worlds.transformers_run import Tokens, tiny_gpt2
    from zero_strategy.transformers import ZeroPlugin, ZeroTrainer

    for field, value in [("torch_compile", True), ("save_only_model", True),
                         ("bf16_full_eval", True), ("fsdp", "full_shard"),
                         ("deepspeed", {"zero_optimization": {"stage": 3},
                                        "train_micro_batch_size_per_gpu": "auto"})]:
        # TrainingArguments writes some of these into os.environ (ACCELERATE_DYNAMO_BACKEND,
        # FSDP_...): none may leak into the rest of this process's tests.
        with mock.patch.dict(os.environ):
            args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                     **{field: value})
            with pytest.raises(ValueError, match=field):
                ZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(),
                            zero_plugin=ZeroPlugin(stage=3))
            del args  # DeepSpeed's config is found through a weak reference to it


def test_with_zero_makes_one_subclass_per_trainer_class() -> None:
    from transformers import Seq2SeqTrainer, Trainer

    from zero_strategy.transformers import ZeroTrainer, with_zero

    zs = with_zero(Seq2SeqTrainer)
    assert zs is with_zero(Seq2SeqTrainer) and issubclass(zs, Seq2SeqTrainer)
    assert with_zero(ZeroTrainer) is ZeroTrainer and issubclass(ZeroTrainer, Trainer)
    with pytest.raises(TypeError, match="Trainer subclass"):
        with_zero(dict)


def test_cpu_processes_without_use_cpu_are_refused(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain Trainer would run each of them alone on the whole data set, silently."""
    from transformers import TrainingArguments

    from tests.worlds.transformers_run import Tokens, tiny_gpt2
    from zero_strategy.transformers import ZeroPlugin, ZeroTrainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("zero_strategy.integrations.hf.trainer.has_accelerator_device",
                        lambda: False)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    with pytest.raises(ValueError, match=r"use_cpu=True"):
        ZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(),
                    zero_plugin=ZeroPlugin(stage=3))
