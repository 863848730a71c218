"""Mixed precision as transformers' Trainer and Accelerate mean it ("bf16-autocast": autocast
over fp32 weights) beside the engine's compute copies ("bf16-mixed"): each against one process
running torch.autocast, the dtypes each forward really computes in, and which one a Trainer
user gets. The scenarios: tests/worlds/scenarios_trainer_precision.py (2 gloo processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.harness import check, run_world

# Why the "-autocast" engine may differ from the reference at all, and by how much.
#
# The reference is one process with fp32 weights whose forward runs under
# torch.autocast("cpu", bf16); it backpropagates each rank's micro-batch loss / N into .grad.
# The engine's forward runs the same module on bit-identical fp32 weights (stage 3 gathers
# fp32; offload only moves them) under the same autocast, so every bf16 cast of a weight,
# every bf16 matmul and every fp32 LayerNorm/loss is the same arithmetic on the same
# operands, and each rank's gradient equals the reference's term for that micro-batch. What
# is left is fp32 summation order: the engine averages the ranks' terms in a reduction
# ((g0 + g1) / 2, bucketed/flattened), the reference adds g0/2 and g1/2 into .grad, which
# differ by at most an ulp of fp32 (2^-24 relative), and AdamW's normalised update passes
# such relative errors through about unchanged: after 4 steps a few ulps (measured: 1.4e-7
# relative to each tensor's largest weight). A 1-ulp weight difference can also, rarely,
# flip one weight's bf16 rounding in a later forward (one weight moving by a bf16 ulp,
# 2^-8 relative), which changes the gradients it touches by at most that relative amount;
# AdamW then moves those weights by at most lr * 2^-8 = 4e-5 per step, i.e. < 1e-4 of
# weights of size ~1 over the steps left. TOL = 1e-4 therefore holds whatever the order,
# while the compute-copy mode ("bf16-mixed": bf16 weights, bf16 gradients) lands about 9e-2
# away: a missed autocast, a bf16 weight copy or a bf16 gradient would fail it by 900x.
TOL = 1e-4
LOSS_TOL = 1e-6  # the forward is the same arithmetic; only the first step's is exactly equal


@pytest.fixture(scope="module")
def world() -> dict:
    return run_world("tests/worlds/scenarios_trainer_precision.py", 2)


@pytest.mark.parametrize("name", ["autocast_stage0", "autocast_stage1", "autocast_stage2",
                                  "autocast_stage3", "autocast_stage2_offload",
                                  "autocast_stage3_offload", "autocast_stage3_ckpt"])
def test_autocast_engine_equals_one_process_under_autocast(world: dict, name: str) -> None:
    results = check(world[name])
    for rank, r in enumerate(results):
        assert r["precision"] == "bf16-autocast"
        assert r["dtypes"] == r["master_dtypes"] == ["torch.float32"]
        assert r["moved"] > 1e-2, "training did not move the weights: parity would be vacuous"
        assert r["rel"] <= TOL, f"rank {rank}: weights differ by {r['rel']:.2e}"
        for step, (a, b) in enumerate(zip(r["losses"], r["ref_losses"])):
            assert a == pytest.approx(b, rel=LOSS_TOL), f"rank {rank} step {step} loss"
    assert results[0]["rel"] == results[1]["rel"], "ranks disagree on consolidated weights"


@pytest.mark.parametrize("stage", [0, 3])
def test_compute_copies_are_a_different_arithmetic(world: dict, stage: int) -> None:
    """The same comparison for "bf16-mixed": it is what the test above would catch."""
    for r in check(world[f"mixed_stage{stage}"]):
        assert r["precision"] == "bf16-mixed" and r["master_dtypes"] == ["torch.float32"]
        assert r["rel"] > 100 * TOL


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_precision_computes_in_the_dtypes_it_claims(world: dict, stage: int) -> None:
    autocast = check(world[f"dtypes_bf16-autocast_stage{stage}"])[0]
    # fp32 weights (as gathered), the op itself autocast to bf16, fp32 gradients for the
    # weight; the autocast ends with the forward (backward and step run outside it)
    assert autocast == {"weight": "torch.float32", "autocast": True,
                        "autocast_dtype": "torch.bfloat16", "input": "torch.bfloat16",
                        "output": "torch.bfloat16", "grad": "torch.float32",
                        "autocast_after": False}
    copies = check(world[f"dtypes_bf16-mixed_stage{stage}"])[0]
    assert {k: copies[k] for k in ("weight", "autocast", "output", "grad")} == {
        "weight": "torch.bfloat16", "autocast": False, "output": "torch.bfloat16",
        "grad": "torch.bfloat16"}


@pytest.mark.parametrize("stage", [0, 3])
def test_generate_runs_in_the_forwards_autocast(world: dict, stage: int) -> None:
    for r in check(world[f"generate_stage{stage}"]):
        assert r["autocast_seen"] == [True]
        assert r["equal"], "greedy tokens differ from the plain model under autocast"


def test_frozen_tensors_keep_their_dtype_under_autocast(world: dict) -> None:
    for r in check(world["frozen_stage0"]):
        assert r == {"bf16-autocast": "torch.bfloat16", "32-true": "torch.float32"}


def _trainer(tmp_path: Path, plugin_options: dict, **args_options: bool):
    from transformers import TrainingArguments

    from tests.worlds.transformers_run import Tokens, tiny_gpt2
    from zero_strategy.transformers import ZeroPlugin, ZeroTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             **args_options)
    return ZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(),
                       zero_plugin=ZeroPlugin(stage=3, **plugin_options))


def test_trainer_bf16_means_autocast_and_the_plugin_can_choose_copies(tmp_path: Path) -> None:
    import torch

    chosen = _trainer(tmp_path, {}, bf16=True).accelerator
    assert chosen.zero_config.precision == "bf16-autocast"
    # accelerator.autocast() (TRL scores under it) is the same autocast as Accelerate's
    with chosen.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    explicit = _trainer(tmp_path, {"precision": "bf16-mixed"}, bf16=True).accelerator
    assert explicit.zero_config.precision == "bf16-mixed"
    assert explicit.mixed_precision == "bf16"  # what Trainer and its callbacks read
    with explicit.autocast():
        assert not torch.is_autocast_enabled("cpu")  # the weights are bf16 already
    assert _trainer(tmp_path, {}).accelerator.zero_config.precision == "32-true"


def test_accelerate_fp16_means_autocast_with_grad_scaler_knobs() -> None:
    from zero_strategy.accelerate import ZeroPlugin

    config = ZeroPlugin().resolve("fp16")
    # torch's GradScaler: 2^16 to start, halved at every overflow, doubled after 2000 steps
    assert config.precision == "16-autocast"
    assert (config.loss_scale.initial_scale, config.loss_scale.growth_interval,
            config.loss_scale.hysteresis) == (2.0**16, 2000, 1)
    # chosen in the plugin: the engine's own defaults stay
    assert ZeroPlugin(precision="16-mixed").resolve("fp16").loss_scale.hysteresis == 2


def test_bad_precision_values_name_the_field() -> None:
    from zero_strategy import ZeroConfig
    from zero_strategy.accelerate import ZeroPlugin
    from zero_strategy.config import ConfigError

    with pytest.raises(ConfigError, match=r"precision must be one of .*'bf16-autocast'.*"
                                          r"got 'bf16-autocst'"):
        ZeroConfig(precision="bf16-autocst")
    with pytest.raises(ConfigError, match=r"ZeroPlugin\(\.\.\.\) arguments: precision must"):
        ZeroPlugin(precision="autocast")
    with pytest.raises(ValueError, match="loss_scale applies to the fp16 precisions"):
        ZeroConfig(precision="bf16-autocast", loss_scale={"growth_interval": 10})
    with pytest.raises(ValueError, match="precision='16-autocast' needs nonfinite_grads='skip'"):
        ZeroConfig(precision="16-autocast", nonfinite_grads="error")
    # the activation formula refuses autocast by name rather than guessing a size
    from transformers import GPT2Config

    from zero_strategy import estimate_activations

    with pytest.raises(ValueError, match="'bf16-autocast'.*autocast"):
        estimate_activations(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=96,
                                        n_positions=32), batch_size=1, seq_len=8,
                             precision="bf16-autocast")


def test_lightning_names_and_autocast_agree() -> None:
    """Lightning's "bf16-mixed" flag runs the compute copies (as its DeepSpeedStrategy does);
    the strategy may choose autocast beside it, and Lightning still reads its own name."""
    from lightning.pytorch import Trainer

    from zero_strategy.lightning import ZeroStrategy

    trainer = Trainer(strategy=ZeroStrategy(precision="bf16-autocast"), accelerator="cpu",
                      devices=2, precision="bf16-mixed", logger=False)
    assert trainer.strategy.config.precision == "bf16-autocast"
    assert trainer.precision == "bf16-mixed"
    plain = Trainer(strategy=ZeroStrategy(), accelerator="cpu", devices=2,
                    precision="bf16-mixed", logger=False)
    assert plain.strategy.config.precision == "bf16-mixed"
