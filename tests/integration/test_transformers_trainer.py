"""transformers.Trainer under ZeRO beyond the quick tier's stage-3 case: stages 1 and 2 and
stage 3 with CPU offload against plain Trainer (DDP), each resumed from checkpoint-2; TRL's
SFTTrainer with a LoRA adapter on a frozen, sharded base; and ``generate()`` at stage 3 with
ranks that stop at different lengths; a bias/LayerNorm-only fine-tune (Trainer's decay group
empty), built whole and streamed from a pretrained folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import trainer_checks as C
from tests.worlds.transformers_run import GENERATE_RANKS_NEW_TOKENS

VARIANTS = ["z1", "z2", "z3off"]
SCENARIOS = ["fit_ddp", *(f"fit_{v}" for v in VARIANTS), *(f"resume_{v}" for v in VARIANTS),
             "sft_ddp", "sft_z0", "sft_z3", "sft_bf16_ddp", "sft_bf16_z3",
             "sft_bf16_z3copies", "generate_ddp", "generate_z2", "generate_z3",
             "generate_z3stream",
             "best_ddp", "best_z3", "precision", "streamed_ddp", "streamed_z3",
             "evaluated_ddp", "evaluated_z0", "evaluated_z3", "seq2seq_ddp", "seq2seq_z3",
             "schedules_ddp", "schedules_z3", "nodecay_ddp", "nodecay_z1", "nodecay_z3",
             "nodecay_streamed_ddp", "nodecay_streamed_z3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return C.launch(tmp_path_factory.mktemp("trainer"), SCENARIOS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainer_matches_ddp(runs: dict, variant: str) -> None:
    C.assert_matches_ddp(runs["fit_ddp"], runs[f"fit_{variant}"], variant)
    C.assert_checkpoint_layout(runs[f"fit_{variant}"]["run"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_equals_uninterrupted(runs: dict, variant: str) -> None:
    C.assert_resume_equals_uninterrupted(runs[f"fit_{variant}"], runs[f"resume_{variant}"],
                                         variant)


def test_sft_lora_at_stage3_equals_the_engine_replicated(runs: dict) -> None:
    """Stage 3 (frozen base sharded, adapter trained) against the same SFTTrainer run with
    nothing sharded (stage 0: the engine's DDP), within the fp32 reordering bound."""
    z0, z3 = C.ok(runs["sft_z0"]), C.ok(runs["sft_z3"])
    for key in ("loss", "grad_norm", "lr"):
        C.assert_close_lists(z0[key], z3[key], f"sft {key}")


def test_sft_lora_at_stage3_equals_plain_trainer(runs: dict) -> None:
    """Against TRL's SFTTrainer under plain Trainer (DDP), fp32 (the scenario turns TRL's
    default bf16 off: see transformers_run._sft_lora), at the same bound as plain Trainer."""
    ddp, z3 = C.ok(runs["sft_ddp"]), C.ok(runs["sft_z3"])
    for key in ("loss", "grad_norm", "lr"):
        C.assert_close_lists(ddp[key], z3[key], f"sft vs DDP {key}")


def _adapter(result: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(result["adapter"]) / "adapter_model.safetensors")


def test_sft_lora_with_trls_default_bf16_equals_plain_trainer(runs: dict) -> None:
    """TRL's default config (bf16=True), 6 steps, stage 3 against plain SFTTrainer (DDP).

    Plain Trainer runs bf16=True as Accelerate's autocast around the model's forward over
    fp32 weights; so does the engine now ("bf16-autocast"). Stage 3 gathers the same fp32
    values, so every bf16 cast, bf16 matmul and fp32 op of each rank's forward and backward
    is the same arithmetic on the same operands as DDP's, and the gradients enter the
    reductions equal. What may differ is fp32 summation order: 2 ranks' terms averaged
    (a + b rounded once either way: DDP's a/2 + b/2 and the engine's (a + b)/2 are the same
    number, halving being exact) and the norm Trainer clips with, summed over shards (at
    most a few ulps, and at max_grad_norm=0.5 with norms ~0.09 the clip factor is 1 either
    way). So the runs agree to the last bit unless a reordering moves a weight by an ulp;
    RTOL (1e-5, the fp32 Trainer bound) leaves room for that through AdamW's normalised
    update. The compute copies ("bf16-mixed", chosen in the plugin) are a different
    arithmetic (bf16 weights and gradients) and land percent-level apart: the contrast shows
    the comparison can tell the two apart."""
    ddp, z3 = C.ok(runs["sft_bf16_ddp"]), C.ok(runs["sft_bf16_z3"])
    assert ddp["bf16"] and z3["bf16"], "TRL's default must be bf16=True for this to test it"
    assert len(ddp["loss"]) == 6
    for key in ("loss", "grad_norm", "lr"):
        C.assert_close_lists(ddp[key], z3[key], f"sft bf16 vs DDP {key}")
    plain, mine = _adapter(ddp), _adapter(z3)
    assert C.max_rel_diff(plain, mine) <= C.RTOL
    total = sum(v.abs().sum().item() for v in plain.values())
    assert abs(total - sum(v.abs().sum().item() for v in mine.values())) <= C.RTOL * total
    copies = _adapter(C.ok(runs["sft_bf16_z3copies"]))
    assert C.max_rel_diff(plain, copies) > 1e-2


def test_lora_adapter_is_saved_as_peft_saves_it(runs: dict) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    from tests.worlds.transformers_run import tiny_gpt2

    z3 = C.ok(runs["sft_z3"])
    adapter = Path(z3["adapter"])
    saved = load_file(adapter / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:5]
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), adapter)
    for key, value in reloaded.state_dict().items():
        if "lora_" in key:
            match = [v for k, v in saved.items() if key.replace(".default", "") == k]
            assert match and torch.equal(match[0], value), key
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # it trained


def test_optimizer_state_exists_only_for_the_adapter(runs: dict) -> None:
    """AdamW keeps two states per trained element; over both ranks at stage 3 that is exactly
    2 x the adapter's size: the frozen base (sharded too) has none."""
    z3 = C.ok(runs["sft_z3"])
    assert z3["optimizer_state_elements"] == 2 * z3["trainable"]
    assert z3["report"]["num_params"] > 10 * z3["trainable"]


@pytest.mark.parametrize("mode", ["ddp", "z2", "z3", "z3stream"])
def test_generate_equals_the_unsharded_model(runs: dict, mode: str) -> None:
    result = C.ok(runs[f"generate_{mode}"])
    assert result["ranks_equal"] == result["world"], result
    # Ranks ask for different lengths. Streaming (every forward a collective), the engine sets
    # synced_gpus: the shorter keeps stepping with the longer one, so rank 0 runs as many
    # forwards as the longest request. Holding the model, each rank stops at its own length.
    longest = max(GENERATE_RANKS_NEW_TOKENS[: result["world"]])
    assert result["forwards"] == (longest if mode == "z3stream" else result["new_tokens"])


@pytest.mark.parametrize("mode", ["z3", "z3stream"])
def test_generate_gathers_each_parameter_once_per_call_or_per_forward(runs: dict,
                                                                      mode: str) -> None:
    """An all-gather of every unit sends (N-1)/N of the model's bytes from each rank (the flat
    units' padding and the gather-order tags add under 1%): once per generate() call when the
    model fits the generation budget (the default, free memory), once per forward when it
    does not (``generation_gather_budget=0``: streamed)."""
    result = C.ok(runs[f"generate_{mode}"])
    n = result["world"]
    per_gather = result["param_bytes"] * (n - 1) / n
    gathers = 1 if mode == "z3" else result["forwards"]
    sent = result["comm"]["all_gather"]
    assert result["gathered_units"] >= 1, result
    assert per_gather * gathers <= sent <= 1.01 * per_gather * gathers, result


def test_best_model_checkpoint_rotation_plateau_schedule_and_callbacks(runs: dict) -> None:
    """Evaluation and a save every step, ReduceLROnPlateau (stepped with the evaluation
    metric), save_total_limit=1 and load_best_model_at_end: the same history, the same
    checkpoints kept, the same best checkpoint, and the best model's weights, as plain
    Trainer; a callback sees the same optimizer and saves."""
    ddp, z3 = C.ok(runs["best_ddp"]), C.ok(runs["best_z3"])
    for key in ("loss", "grad_norm", "eval_loss", "lr"):
        C.assert_close_lists(ddp[key], z3[key], f"best {key}")
    assert len(set(ddp["lr"])) > 1  # the plateau schedule did reduce the lr
    assert (z3["best"], z3["checkpoints"], z3["saved"]) == (
        ddp["best"], ddp["checkpoints"], ddp["saved"])
    diff = C.max_rel_diff(C.weights(ddp["final"]), C.weights(z3["final"]))
    assert diff <= C.RTOL, diff


def test_precision_follows_training_arguments(runs: dict) -> None:
    result = C.ok(runs["precision"])
    assert (result["bf16"], result["fp16"]) == ("bf16-autocast", "16-autocast")
    assert "precision='32-true'" in result["clash"] and "bf16=True" in result["clash"]


def test_streamed_pretrained_model_trains_as_from_pretrained_does(runs: dict) -> None:
    """``zero_strategy.transformers.from_pretrained`` (meta, each rank reading its ranges)
    under a ZeRO Trainer against ``GPT2LMHeadModel.from_pretrained`` under plain Trainer."""
    ddp, z3 = C.ok(runs["streamed_ddp"]), C.ok(runs["streamed_z3"])
    assert z3["built_on_meta"] and not ddp["built_on_meta"]
    for key in ("loss", "grad_norm", "lr"):
        C.assert_close_lists(ddp[key], z3[key], f"streamed {key}")
    assert C.max_rel_diff(C.weights(ddp["final"]), C.weights(z3["final"])) <= C.RTOL


def test_evaluate_before_train_on_a_streamed_model(runs: dict) -> None:
    """evaluate() before train() builds the engine for a model still on meta: the same
    evaluation loss as plain Trainer on the same weights, and the training after it is the
    same whether nothing is sharded (stage 0) or everything is (stage 3). Plain Trainer is no
    reference for that training: after an early evaluate() it never wraps the model in DDP
    (transformers 5.23), so its ranks train apart."""
    ddp, z0, z3 = (C.ok(runs[k]) for k in ("evaluated_ddp", "evaluated_z0", "evaluated_z3"))
    C.assert_close_lists([ddp["eval_before"]] * 2, [z0["eval_before"], z3["eval_before"]],
                         "eval before train")
    for key in ("loss", "grad_norm", "lr"):
        C.assert_close_lists(z0[key], z3[key], f"after an early evaluation: {key}")


def test_seq2seq_predict_with_generate_equals_plain_trainer(runs: dict) -> None:
    """``with_zero(Seq2SeqTrainer)`` with ``predict_with_generate``: the tokens every rank
    generated, gathered and padded by Trainer, equal plain Seq2SeqTrainer's under DDP."""
    ddp, z3 = C.ok(runs["seq2seq_ddp"]), C.ok(runs["seq2seq_z3"])
    assert torch.equal(torch.load(ddp["tokens"]), torch.load(z3["tokens"]))
    # predict's generate() calls ran in the generation mode: every unit held for each call
    assert z3["held"] == z3["units"] >= 1, z3


def test_every_lr_scheduler_type_matches_plain_trainer(runs: dict) -> None:
    """The plateau schedule is in the best-model test; every other one here: the same lr at
    every step, and the same losses, as plain Trainer."""
    ddp, z3 = C.ok(runs["schedules_ddp"]), C.ok(runs["schedules_z3"])
    assert ddp.keys() == z3.keys() and len(ddp) > 5
    for name in ddp:
        if name == "seconds":
            continue
        C.assert_close_lists(ddp[name]["lr"], z3[name]["lr"], f"{name} lr")
        C.assert_close_lists(ddp[name]["loss"], z3[name]["loss"], f"{name} loss")


@pytest.mark.parametrize("case", ["z1", "z3", "streamed_z3"])
def test_no_decay_only_fine_tune_equals_plain_trainer(runs: dict, case: str) -> None:
    """Only biases and LayerNorms train (streamed: only ``ln_f``), so Trainer's first param
    group, the weight-decay one, is empty: it crashed ``ZeroAccelerator.prepare`` with an
    IndexError. Now the same history and saved weights as plain Trainer (DDP) within its
    bound, and the frozen weights bit for bit."""
    reference = "nodecay_streamed_ddp" if case.startswith("streamed") else "nodecay_ddp"
    ddp, zero = C.ok(runs[reference]), C.ok(runs[f"nodecay_{case}"])
    assert ddp["group_sizes"][0] == 0 and ddp["group_sizes"][1] > 0, ddp["group_sizes"]
    # the user's groups keep their places; stage 3 appends one for the frozen weights it
    # shards (lr 0: nothing moves them, see integrations/hf/trainer.py)
    assert zero["group_sizes"][:2] == ddp["group_sizes"], zero["group_sizes"]
    assert zero["trained"] == ddp["trained"]
    for key in ("loss", "grad_norm", "lr"):
        C.assert_close_lists(ddp[key], zero[key], f"no-decay {case} {key}")
    ours, theirs = C.weights(zero["final"]), C.weights(ddp["final"])
    C.assert_key_bias_inert(ours, lr=1e-2, steps=len(zero["loss"]))
    diff = C.max_rel_diff(theirs, ours)
    assert diff <= C.RTOL, f"saved weights differ from plain Trainer's by {diff:.2e}"
    frozen = [k for k in theirs if k not in ddp["trained"]]
    assert frozen and all(torch.equal(ours[k], theirs[k]) for k in frozen), "a frozen one moved"
