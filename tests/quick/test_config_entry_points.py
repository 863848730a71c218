"""One wrong config value, the same message from every entry point: ``ZeroConfig.from_dict``,
Lightning's and Fabric's strategy arguments, ``ZeroPlugin`` in code and its YAML file,
``ZeroTrainer``'s plugin (from ``$ZERO_STRATEGY_CONFIG``), Hydra's ``strategy.zero`` (the
check before workers start, and the strategy a worker builds). Each message is the entry
point's name, then the words ``ZeroConfig.from_options`` uses; none of this starts a process.
Precision contradictions read alike from every adapter too (``reconcile_precision``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.support.recipe_runs import compose_config
from zero_strategy import ZeroConfig
from zero_strategy.accelerate import CONFIG_ENV, ZeroPlugin
from zero_strategy.config import ConfigError

# (values, the Hydra overrides that set the same, the message after the entry point's name)
CASES = [
    pytest.param({"bucket_numl": 5}, ["+strategy.zero.bucket_numl=5"],
                 "unknown ZeroConfig key(s) ['bucket_numl'] (did you mean 'bucket_numel'?); "
                 "allowed keys: ", id="unknown key"),
    pytest.param({"quantize_weights": "int4"}, ["strategy.zero.quantize_weights=int4"],
                 "quantize_weights must be one of ('off', 'int8'), got 'int4'", id="choice"),
    pytest.param({"bucket_numel": 1.5}, ["strategy.zero.bucket_numel=1.5"],
                 "bucket_numel must be a positive int, got 1.5", id="type"),
    pytest.param({"overlap_param_gather": 1}, ["strategy.zero.overlap_param_gather=1"],
                 "overlap_param_gather must be True or False, got 1", id="int for bool"),
    pytest.param({"loss_scale": {"growth_interval": "often"}},
                 ["strategy.zero.loss_scale={growth_interval:often}"],
                 "loss_scale.growth_interval must be a positive int, got 'often'", id="nested"),
    pytest.param({"stage": 2, "unit_numel": 10}, ["strategy=zero2", "strategy.zero.unit_numel=10"],
                 "unit_numel applies to stage 3 only", id="value"),
]


def _message(build: Callable[[], Any]) -> str:
    with pytest.raises(ConfigError) as err:
        build()
    assert isinstance(err.value, ValueError) and isinstance(err.value, TypeError)
    return str(err.value)


def _entry_points(values: dict, overrides: list[str], tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Callable[[], Any]]]:
    """Each entry point fed ``values``, with the name its messages start with."""
    from recipes import launch, worker
    from zero_strategy.fabric import ZeroFabricStrategy
    from zero_strategy.lightning import ZeroStrategy

    plugin_file = tmp_path / "plugin.yaml"
    plugin_file.write_text(yaml.safe_dump(values))
    hydra = compose_config(overrides)

    def trainer() -> Any:
        from zero_strategy.transformers import ZeroTrainer

        monkeypatch.setenv(CONFIG_ENV, str(plugin_file))
        try:
            return ZeroTrainer(model=torch.nn.Linear(2, 2))  # the plugin is read first
        finally:
            monkeypatch.delenv(CONFIG_ENV)

    return [
        ("config", lambda: ZeroConfig.from_dict(values)),
        ("ZeroStrategy(...) arguments", lambda: ZeroStrategy(**values)),
        ("ZeroFabricStrategy(...) arguments", lambda: ZeroFabricStrategy(**values)),
        ("ZeroPlugin(...) arguments", lambda: ZeroPlugin(**values)),
        (f"zero plugin config {plugin_file}", lambda: ZeroPlugin.from_config(plugin_file)),
        (f"zero plugin config {plugin_file}", trainer),  # the same file, through ZeroTrainer
        ("strategy.zero", lambda: launch.check_strategy(hydra)),  # before workers start
        ("ZeroStrategy(...) arguments", lambda: worker.make_strategy(hydra, None)),  # a worker
    ]


@pytest.mark.parametrize(("values", "overrides", "body"), CASES)
def test_a_wrong_value_reads_the_same_from_every_entry_point(
        values: dict, overrides: list[str], body: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _message(lambda: ZeroConfig.from_options(values, source="x")).removeprefix("x: ")
    assert expected.startswith(body)
    entry_points = _entry_points(values, overrides, tmp_path, monkeypatch)
    for source, build in entry_points:
        assert _message(build) == f"{source}: {expected}", source


def test_a_precision_contradiction_reads_alike_from_every_adapter(tmp_path: Path) -> None:
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer
    from transformers import TrainingArguments

    from zero_strategy.fabric import ZeroFabricStrategy
    from zero_strategy.lightning import ZeroStrategy
    from zero_strategy.transformers import ZeroTrainer

    def conflict(chosen: str, setting: str, agrees: list[str]) -> str:
        return (f"precision conflict: precision={chosen!r} contradicts {setting}; set it in one "
                f"place, or make them agree ({setting} allows {agrees}, not {chosen!r})")

    lightning = _message(lambda: Trainer(strategy=ZeroStrategy(precision="bf16-mixed"),
                                         accelerator="cpu", devices=2, precision="bf16-true"))
    assert lightning == "ZeroStrategy(...) arguments: " + conflict(
        "bf16-mixed", "Trainer(precision='bf16-true')", ["bf16-true"])
    fabric = _message(lambda: Fabric(strategy=ZeroFabricStrategy(precision="bf16-mixed"),
                                     accelerator="cpu", devices=2, precision="bf16-true"))
    assert fabric == "ZeroFabricStrategy(...) arguments: " + conflict(
        "bf16-mixed", "Fabric(precision='bf16-true')", ["bf16-true"])
    accelerate = _message(lambda: ZeroPlugin(precision="16-mixed").resolve("bf16"))
    assert accelerate == "ZeroPlugin(...) arguments: " + conflict(
        "16-mixed", "Accelerate's mixed_precision='bf16'",
        ["bf16-mixed", "bf16-true", "bf16-autocast"])
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=True)
    trainer = _message(lambda: ZeroTrainer(model=torch.nn.Linear(2, 2), args=args,
                                           zero_plugin=ZeroPlugin(precision="32-true")))
    assert trainer == "ZeroPlugin(...) arguments: " + conflict(
        "32-true", "TrainingArguments(bf16=True)", ["bf16-mixed", "bf16-true", "bf16-autocast"])
