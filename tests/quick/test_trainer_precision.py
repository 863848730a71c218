"""Which mixed precision a user gets: transformers' Trainer and Accelerate mean "bf16-autocast"
(autocast over fp32 weights), the plugin may choose the compute copies ("bf16-mixed"), and
bad values name the field. The arithmetic of each against one process under torch.autocast:
tests/integration/test_trainer_precision_worlds.py."""

from __future__ import annotations

from pathlib import Path

import pytest


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
