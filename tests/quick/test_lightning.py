"""``Trainer(strategy="zero*")`` against ``strategy="ddp"``, checkpoints, Hydra launching.

The distributed runs happen in scripts launched the way a user would (see
tests/worlds/lightning_launch.py): tests/worlds/lightning_run.py runs the Trainer scenarios of
the stage-3 presets in one pair of processes (DDP reference first; the other presets run in
tests/integration/test_lightning_presets.py), tests/worlds/lightning_hydra_app.py is a Hydra
app run as a single job (as a ``-m`` sweep: tests/integration/test_lightning_hydra.py). They
start together (the machine waits on process start-up more
than it computes); the tests below assert on what they recorded. Construction-time checks run
in this process: they must fail before any process is started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zero_strategy as zs
from tests.support import several_optimizers as so
from tests.support.lightning_checks import (
    TOL,
    parametrize_presets,
    test_accumulation_skips_gradient_communication,
    test_checkpoint_after_fit_evaluates_and_consolidates,
    test_load_from_checkpoint_on_the_path_model_checkpoint_reports,
    test_log_validate_test_predict_and_summary,
    test_matches_ddp,
    test_resume_from_model_checkpoint_is_exact,
)
from tests.worlds.lightning_launch import QUICK_PRESETS, check, hydra_run, suite_results
from zero_strategy.fabric import PRESETS
from zero_strategy.integrations.hydra_launch import _hydra_cli_flags
from zero_strategy.lightning import ZeroPrecision, ZeroStrategy

__all__ = [  # the shared preset checks, collected here for the stage-3 presets
    "test_accumulation_skips_gradient_communication",
    "test_checkpoint_after_fit_evaluates_and_consolidates",
    "test_load_from_checkpoint_on_the_path_model_checkpoint_reports",
    "test_log_validate_test_predict_and_summary", "test_matches_ddp",
    "test_resume_from_model_checkpoint_is_exact",
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The shared preset checks (tests/support/lightning_checks.py) for the stage-3 presets;
    the others run in tests/integration/test_lightning_presets.py."""
    parametrize_presets(metafunc, QUICK_PRESETS)


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """The Trainer suite and a Hydra run, started together (the ``-m`` sweep runs in
    tests/integration/test_lightning_hydra.py)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        single = pool.submit(hydra_run, ["lr=0.3", "out=OUT", "hydra.run.dir=OUT/run"])
        suite = pool.submit(suite_results)
        return {"suite": suite.result(), "single": single.result()}


@pytest.fixture(scope="module")
def suite(runs: dict[str, Any]) -> dict[str, list[Any]]:
    return runs["suite"]


# ---------------------------------------------------------------------- parity with DDP
def test_clip_by_value_matches_ddp(suite: dict) -> None:
    """gradient_clip_algorithm="value" clamps the engine's shards: same as DDP's clamp."""
    for r, ref in zip(check(suite["zero3_value"]), check(suite["ddp_value"])):
        for a, b in zip(r["loss"], ref["loss"]):
            assert a == pytest.approx(b, rel=TOL, abs=1e-7)
        assert r["rel_vs_ddp"] <= TOL
        assert ref["largest_grad"] > 0.5, "the clamp at 0.5 never engaged"


def test_activation_checkpointing_through_the_strategy(suite: dict) -> None:
    for r, ref in zip(check(suite["zero3_checkpointed"]), check(suite["ddp"])):
        assert r["checkpointed"] == 3  # the MLP's three blocks
        assert r["offloaded"] == 3 * 4 * 33 * 4  # each block's input (batch 4 x 33, fp32)
        for a, b in zip(r["loss"], ref["loss"]):
            assert a == pytest.approx(b, rel=TOL, abs=1e-7)
        assert r["rel_vs_ddp"] <= TOL


# ---------------------------------------------------------------------- checkpoints
def test_load_from_checkpoint_without_lightning_state_names_the_command(
        suite: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint ZeroEngine.save_checkpoint wrote has no Lightning state: the error names
    the conversion command (load_from_checkpoint and ``zero-strategy consolidate ... .ckpt``)."""
    from zero_strategy import cli

    failed = check(suite["zero3"])[0]["engine_only_error"]
    command = f"zero-strategy consolidate {failed['dir']} model.safetensors"
    assert "without Lightning state" in failed["error"] and command in failed["error"], failed
    assert cli.main(["consolidate", failed["dir"], str(tmp_path / "model.ckpt")]) == 2
    assert command in capsys.readouterr().err and not (tmp_path / "model.ckpt").exists()
    assert cli.main(["consolidate", failed["dir"], str(tmp_path / "model.safetensors")]) == 0


def test_load_from_checkpoint_leaves_other_paths_to_lightning(tmp_path: Path) -> None:
    """The hook takes zero_strategy checkpoint directories only: any other directory still
    gets Lightning's own error, a file still loads as Lightning loads it."""
    from lightning.pytorch.core import saving

    from zero_strategy.lightning import is_zero_checkpoint

    assert getattr(saving.pl_load, "_zero_strategy", False), "the loader hook is not installed"
    with pytest.raises(IsADirectoryError):
        TinyModule.load_from_checkpoint(tmp_path)
    model = TinyModule()
    torch.save({"state_dict": model.state_dict(), "pytorch-lightning_version": L.__version__},
               tmp_path / "plain.ckpt")
    loaded = TinyModule.load_from_checkpoint(tmp_path / "plain.ckpt")
    assert torch.equal(loaded.layer.weight, model.layer.weight)
    (tmp_path / "ck").mkdir()
    assert not is_zero_checkpoint(tmp_path / "ck") and not is_zero_checkpoint("s3://b/ck")
    (tmp_path / "ck" / "latest").write_text("checkpoint")
    assert is_zero_checkpoint(tmp_path / "ck") and is_zero_checkpoint(str(tmp_path / "ck"))


# ---------------------------------------------------------------------- other behaviour
def test_fit_refuses_forged_checkpoints_before_changing_anything(suite: dict) -> None:
    """``fit(ckpt_path=)`` with a framework-state payload (refused by weights_only) or a
    ``latest`` that leaves the directory: raises, the model keeps its weights, nothing ran."""
    expected = {"framework_payload": "cannot be loaded with weights_only",
                "traversal": "is not a plain file or directory name"}
    for r in check(suite["hostile_fit"]):
        for name, text in expected.items():
            assert r[name]["raised"] is not None and text in r[name]["raised"], (name, r[name])
            assert r[name]["untouched"] and not r[name]["marker"], (name, r[name])


def test_bf16_mixed_flag_reaches_the_engine(suite: dict) -> None:
    for r in check(suite["bf16"]):
        assert r["config"] == "bf16-mixed" and r["plugin"] == "ZeroPrecision"
        assert r["compute"] == "torch.bfloat16" and r["master"] == ["torch.float32"]
        assert all(torch.isfinite(torch.tensor(r["loss"])))


def test_two_optimizers_refused(suite: dict) -> None:
    for message in check(suite["two_optimizers"]):
        assert "returned 2" in message and "zero_strategy.CombinedOptimizer([" in message


def test_combined_optimizer(suite: dict) -> None:
    """configure_optimizers returns CombinedOptimizer([muon, adamw]) with a LambdaLR on the
    Muon part: one engine step per optimizer step, the weights of single-process training
    (tolerance: so.TOL), the Muon part's lr scheduled and AdamW's
    not; resumed from trainer.save_checkpoint by a fresh module for a second epoch, both the
    weights and the schedule continue as in the uninterrupted reference."""
    for r in check(suite["combined_optimizer"]):
        assert r["combined"] == "CombinedOptimizer" and r["engine_steps"] == so.STEPS
        assert r["rel"] <= so.TOL, f"weights differ by {r['rel']}"
        assert r["moved"] > 1e-2
        assert r["lr"] == [[so.MUON_LR * so.muon_factor(i), so.ADAMW_LR]
                           for i in range(2 * so.STEPS)]
        assert r["resumed_step"] == 2 * so.STEPS
        assert r["resumed_rel"] <= so.TOL, f"resumed weights differ by {r['resumed_rel']}"


# ---------------------------------------------------------------------- Hydra
def test_hydra_single_run(runs: dict) -> None:
    records, log = runs["single"]
    assert sorted(r["rank"] for r in records) == [0, 1], log[-4000:]
    assert all(r["world_size"] == 2 and r["lr"] == 0.3 for r in records)
    assert records[0]["job_dir"] == records[1]["job_dir"]
    assert records[0]["job_dir"].endswith("/run")


def test_hydra_child_keeps_config_flags_only() -> None:
    argv = ["-m", "--config-name", "train", "lr=1,2", "-cp=conf", "--config-dir", "d", "+x=1"]
    assert _hydra_cli_flags(argv) == ["--config-name", "train", "-cp=conf", "--config-dir", "d"]


# ---------------------------------------------------------------------- in this process
class TinyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TwoOptimizers(TinyModule):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD([self.layer.weight], lr=0.1),
                torch.optim.SGD([self.layer.bias], lr=0.1)]


def make_trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, max_steps=1, **kwargs)


def tiny_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)


def test_registered_names() -> None:
    for name, preset in PRESETS.items():
        assert name in StrategyRegistry, name
        strategy = make_trainer(name).strategy
        assert isinstance(strategy, ZeroStrategy)
        for field, value in preset.items():
            assert getattr(strategy.config, field) == value, (name, field)
    offload = make_trainer("zero3_offload").strategy.config
    assert offload.offload_optimizer and offload.offload_params


@pytest.mark.filterwarnings("ignore:.*AMP with fp16 is not supported on CPU")
@pytest.mark.parametrize("flag, expected", [
    ("32-true", "32-true"), ("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-true"),
    ("16-mixed", "bf16-mixed"),  # Lightning turns fp16 AMP on CPU into bf16 (with a warning)
])
def test_precision_flag_maps_onto_config(flag: str, expected: str) -> None:
    trainer = make_trainer("zero2", precision=flag)
    assert trainer.strategy.config.precision == expected
    assert isinstance(trainer.precision_plugin, ZeroPrecision)
    assert trainer.precision_plugin.precision == expected


def test_precision_from_config_and_conflicts() -> None:
    cfg = zs.ZeroConfig(stage=1, precision="bf16-true")
    assert make_trainer(ZeroStrategy(config=cfg)).strategy.config.precision == "bf16-true"
    assert make_trainer(ZeroStrategy(precision="bf16-mixed"),
                        precision="bf16-mixed").strategy.config.precision == "bf16-mixed"
    with pytest.raises(ValueError, match="precision conflict.*'bf16-true'.*'bf16-mixed'"):
        make_trainer(ZeroStrategy(precision="bf16-mixed"), precision="bf16-true")
    with pytest.raises(ValueError, match="precision='16-true'.*allowed"):
        make_trainer("zero3", precision="16-true")
    with pytest.raises(TypeError, match="DoublePrecision"):
        make_trainer("zero3", precision="64-true")


def test_bad_options_name_the_field() -> None:
    with pytest.raises(TypeError, match="unknown ZeroConfig key.*'stages'.*allowed.*'stage'"):
        ZeroStrategy(stages=3)
    with pytest.raises(ValueError, match="stage must be one of"):
        ZeroStrategy(stage=4)
    with pytest.raises(ValueError, match="offload_params requires stage=3"):
        ZeroStrategy(stage=2, offload_params=True)
    with pytest.raises(TypeError, match="must be a ZeroConfig"):
        ZeroStrategy(config={"stage": 3})


@pytest.mark.parametrize("module, kwargs, match", [
    (TwoOptimizers, {}, r"returned 2.*CombinedOptimizer\(\[muon, adamw\]\)"),
])
def test_refused_before_any_process_starts(module: type, kwargs: dict, match: str) -> None:
    trainer = make_trainer("zero2", **kwargs)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module(), tiny_loader())
    assert trainer.strategy.launcher.procs == [], "processes were started"
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("name", ["finetune_zero2", "finetune_zero3"])
def test_backbone_finetuning_callback(suite: dict[str, list[Any]], name: str) -> None:
    # Reference: stage 0 (data parallel; the engine follows the unfreeze at every stage).
    # Lightning's own DDP is not one here: DDP registers the parameters that require grad at
    # wrap time, so a backbone unfrozen later is never all-reduced and ranks drift apart.
    for r, ref in zip(check(suite[name]), check(suite["finetune_zero0"])):
        assert r["frozen_epoch_change"] == 0.0, "the frozen backbone moved in epoch 0"
        assert r["trained_epoch_change"] > 1e-4, "the unfrozen backbone did not train"
        assert r["groups"] == 2
        a = {k: torch.tensor(v) for k, v in r["weights"].items()}
        b = {k: torch.tensor(v) for k, v in ref["weights"].items()}
        worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)
        assert worst <= TOL, f"{name} differs from stage 0 by {worst:.2e}"


def test_empty_first_param_group_trains_as_ddp(suite: dict[str, list[Any]]) -> None:
    """A bias/LayerNorm-only fine-tune whose weight-decay group (the first) is empty, at
    stage 3 with every parameter sharded, against Lightning's DDP (TOL: fp32 summation order)."""
    for r, ref in zip(check(suite["nodecay_zero3"]), check(suite["nodecay_ddp"])):
        assert r["moved"] == ref["moved"] and r["moved"], "other parameters trained than DDP's"
        assert all(k.endswith("bias") or ".norm." in k for k in r["moved"]), r["moved"]
        assert r["lrs"] == ref["lrs"] and r["lrs"][0] != r["lrs"][1], "per-group lrs differ"
        a = {k: torch.tensor(v) for k, v in r["weights"].items()}
        b = {k: torch.tensor(v) for k, v in ref["weights"].items()}
        worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)
        assert worst <= TOL, f"differs from DDP by {worst:.2e}"
        for x, y in zip(r["loss"], ref["loss"]):
            assert x == pytest.approx(y, rel=TOL)


def test_every_preset_is_trained_in_one_tier() -> None:
    """A preset added to the package is trained against DDP by one of the two tiers."""
    from tests.worlds.lightning_launch import OTHER_PRESETS

    tiers = [*QUICK_PRESETS, *OTHER_PRESETS]
    assert sorted(tiers) == sorted({*PRESETS, "zero3_units"}) and len(set(tiers)) == len(tiers)
