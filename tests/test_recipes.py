"""The Hydra recipes: every config composes against the schema, bad overrides name the key, a
fast two-strategy sweep runs as real 2-process jobs and writes the report."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
sys.path.insert(0, str(ROOT / "recipes"))

import schema  # noqa: E402

schema.register()


def _compose(overrides: list[str]):  # noqa: ANN202
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "strategy", "precision", "trainer", "optim"])
def test_every_group_option_composes(group: str) -> None:
    for option in _options(group):
        cfg = _compose([f"{group}={option}"])
        assert cfg.trainer.devices >= 1 and cfg.model.name in ("gpt", "bert", "resnet")


def test_model_selects_matching_data() -> None:
    assert _compose(["model=bert"]).data.kind == "masked"
    assert _compose(["model=resnet"]).data.kind == "digits"
    assert _compose([]).data.kind == "causal"


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_composes(experiment: str) -> None:
    cfg = _compose([f"experiment={experiment}"])
    assert cfg.name


def test_strategies_map_onto_zero_config() -> None:
    import zero_strategy as zs

    for option in _options("strategy"):
        s = _compose([f"strategy={option}"]).strategy
        if s.name == "ddp":
            assert s.stage is None
            continue
        cfg = zs.ZeroConfig(stage=s.stage, **s.zero)  # every preset is a valid engine config
        assert s.name.startswith(f"zero{cfg.stage}")
        assert cfg.offload_optimizer == s.name.endswith("offload")


def test_optuna_search_composes() -> None:
    cfg = _compose(["hparams_search=optuna"])
    assert cfg.trainer.max_steps > 0


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "recipes" / "train.py"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.mark.parametrize(("override", "key"), [("strategy=zero4", "strategy"),
                                              ("trainer.max_steps=abc", "trainer.max_steps"),
                                              ("model.size=huge", "model.size"),
                                              ("trainer.max_stepz=3", "max_stepz")])
def test_wrong_override_names_the_key(override: str, key: str, tmp_path: Path) -> None:
    run = _run(override, "--cfg", "job", cwd=tmp_path)
    assert run.returncode != 0 and key in run.stderr + run.stdout


def test_fast_sweep_writes_report(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run = _run("-m", "strategy=ddp,zero3", "trainer=fast", "model.size=tiny",
               "trainer.max_steps=6", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    for name in ("report.md", "report.csv", "report.png"):
        assert (sweep / name).stat().st_size > 0
    with open(sweep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["strategy"] for r in rows] == ["ddp", "zero3"]
    for r in rows:
        assert float(r["samples_per_s"]) > 0 and float(r["comm_mib_per_step"]) > 0
        assert float(r["model_state_mib"]) == pytest.approx(float(r["predicted_mib"]), rel=0.05)
        assert float(r["train_loss"]) < float(r["first_loss"])
        assert float(r["val_loss"]) > 0
    ddp, zero3 = rows
    assert float(zero3["model_state_mib"]) < 0.6 * float(ddp["model_state_mib"])
    # identical data and initial weights: the first loss is the same under both strategies
    assert float(zero3["first_loss"]) == pytest.approx(float(ddp["first_loss"]), rel=1e-5)
    assert run.stdout.count("processes: ") == 2, "each job must run exactly once"
