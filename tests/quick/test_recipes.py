"""The Hydra recipes: every config composes against the schema, bad overrides name the key, a
fast two-strategy sweep runs as real 2-process jobs and writes the report."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import torch

from recipes import schema
from tests.support.recipe_runs import (
    FAST,
    compose_config,
    fast_sweep,
    options,
    run_train,
)


@pytest.mark.parametrize("group", ["model", "strategy", "precision", "trainer", "optim"])
def test_every_group_option_composes(group: str) -> None:
    for option in options(group):
        cfg = compose_config([f"{group}={option}"])
        assert cfg.trainer.devices >= 1 and cfg.model.name in ("gpt", "bert", "resnet")


def test_model_selects_matching_data() -> None:
    assert compose_config(["model=bert"]).data.kind == "masked"
    assert compose_config(["model=resnet"]).data.kind == "digits"
    assert compose_config([]).data.kind == "causal"


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes(experiment: str) -> None:
    cfg = compose_config([f"experiment={experiment}"])
    assert cfg.name


def test_strategies_map_onto_zero_config() -> None:
    import zero_strategy as zs

    for option in options("strategy"):
        s = compose_config([f"strategy={option}"]).strategy
        if str(s.impl) == "ddp":
            assert s.stage is None
            continue
        if str(s.impl) != "zero":  # the anchors: test_recipe_anchors.py
            continue
        # every preset is a valid engine config
        cfg = zs.ZeroConfig(stage=s.stage, **schema.zero_options(s.zero))
        assert s.name.startswith(f"zero{cfg.stage}")
        tier = {"offload": "cpu", "disk": "disk"}.get(s.name.rsplit("_", 1)[-1], "device")
        assert cfg.optimizer_tier == tier
        assert cfg.params_tier == (tier if cfg.stage == 3 else "device")


def test_optuna_search_composes() -> None:
    cfg = compose_config(["hparams_search=optuna"])
    assert cfg.trainer.max_steps > 0
    assert cfg.optimized_metric == "val_loss" and compose_config([]).optimized_metric is None


def test_objective_names_the_metric_and_why_a_trial_has_none() -> None:
    """What the job returns to the sweeper: the optimized metric of the final model; a job
    without a finite one fails (Optuna marks the trial failed) saying which and why, where a
    NaN used to reach Optuna and crash the study."""
    from recipes import launch

    ran = {"name": "gpt-tiny-zero3", "steps": 3, "val_step": 3, "val_loss": 2.5,
           "train_loss": 2.7, "val_acc": None}
    assert launch.objective(ran, "val_loss") == 2.5
    assert launch.objective(ran, "train_loss") == 2.7
    assert launch.objective(ran, None) == 2.5
    never = {**ran, "val_step": None, "val_loss": float("nan")}
    assert launch.objective(never, None) != launch.objective(never, None)  # NaN: nobody reads it
    with pytest.raises(RuntimeError, match=r"'gpt-tiny-zero3' has no val_loss .*no validation "
                                           r"ran \(trainer.limit_val_batches=0"):
        launch.objective(never, "val_loss")
    with pytest.raises(RuntimeError, match="has no val_acc"):
        launch.objective(ran, "val_acc")
    diverged = {**ran, "val_loss": float("nan")}
    with pytest.raises(RuntimeError, match=r"val_loss is nan after 3 steps \(training diverged"):
        launch.objective(diverged, "val_loss")


@pytest.mark.parametrize(("overrides", "named"), [
    (["optimized_metric=val_acc"], "model=resnet only"),
    (["optimized_metric=val_los"], "optimized_metric='val_los' is not one of"),
])
def test_an_objective_that_cannot_be_measured_is_refused_before_workers_start(
        overrides: list[str], named: str) -> None:
    from recipes import launch

    cfg = compose_config(["hparams_search=optuna", *overrides])
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        launch.check_job(cfg)


def test_report_columns_are_read_from_the_run() -> None:
    """precision=fp16 on a CPU: Lightning runs bf16-mixed, and the record says so (from the
    Trainer's precision plugin, or the engine's policy once it exists); the strategy name and
    stage from the strategy object, N from the Trainer, the optimizer from its classes."""
    from types import SimpleNamespace

    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    import zero_strategy as zs
    from recipes import metrics
    from zero_strategy.lightning import ZeroStrategy

    def trainer(strategy: object) -> L.Trainer:
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision="16-mixed",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)

    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        zero, ddp = trainer("zero3"), trainer(DDPStrategy())
    assert metrics.run_columns(zero) == {"strategy": "zero3", "stage": 3, "world_size": 2,
                                         "precision": "bf16-mixed", "optim": None,
                                         "zero_options": None}
    assert metrics.run_columns(ddp) == {"strategy": "ddp", "stage": None, "world_size": 2,
                                        "precision": "bf16-mixed", "optim": None,
                                        "zero_options": None}
    assert metrics.strategy_label(ZeroStrategy(stage=2, offload_optimizer=True)) == (
        "zero2_offload", 2)
    assert metrics.strategy_label(ZeroStrategy(stage=3, offload_optimizer=True)) == (
        "zero3_offload_optimizer", 3)
    assert metrics.strategy_label(ZeroStrategy(stage=3, offload_optimizer=True,
                                               offload_params=True)) == ("zero3_offload", 3)
    assert metrics.strategy_label(ZeroStrategy(stage=3, offload_optimizer="disk",
                                               offload_params="disk")) == ("zero3_disk", 3)
    assert metrics.strategy_label(ZeroStrategy(stage=3, offload_optimizer="disk")) == (
        "zero3_disk_optimizer", 3)
    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    combined = zs.CombinedOptimizer([torch.optim.SGD(params[:1]), torch.optim.AdamW(params[1:])])
    engine = SimpleNamespace(plan=SimpleNamespace(policy=SimpleNamespace(name="bf16-true")),
                             config=zs.ZeroConfig(stage=1, quantize_gradients="int8",
                                                  shard_group_size=2))
    ran = SimpleNamespace(strategy=SimpleNamespace(config=zs.ZeroConfig(stage=1), engine=engine),
                          precision="32-true", world_size=4, optimizers=[combined])
    assert metrics.run_columns(ran) == {
        "strategy": "zero1", "stage": 1, "world_size": 4, "precision": "bf16-true",
        "optim": "sgd+adamw", "zero_options": "quantize_gradients=int8, shard_group_size=2"}


def test_report_lists_what_did_not_run_as_requested(tmp_path: Path) -> None:
    from recipes import report

    for i, (asked, ran) in enumerate([("32-true", "32-true"), ("16-mixed", "bf16-mixed")]):
        (tmp_path / f"{i}-job").mkdir()
        (tmp_path / f"{i}-job" / "metrics.json").write_text(json.dumps({
            "strategy": "zero3", "precision": ran, "world_size": 2,
            "requested": {"strategy": "zero3", "precision": asked, "world_size": 2},
            "ranks": [{"peak_rss_mib": 1, "model_state_bytes": 1, "predicted_bytes": 1}],
            "comm_bytes_per_step": 0}))
    same, changed = report.rows(tmp_path)
    assert report.changed_by_the_run(same) == []
    assert report.changed_by_the_run(changed) == [
        "precision requested '16-mixed', ran 'bf16-mixed'"]
    # Rows that differ only in engine options get a column saying which (else they would
    # look alike); without such a sweep the column is left out.
    assert report.OPTIONS not in report.columns([same, changed])
    options = [dict(same, zero_options="defaults"),
               dict(same, zero_options="quantize_weights=int8")]
    assert report.columns(options)[1] == report.OPTIONS


@pytest.mark.parametrize(("override", "key"), [("strategy=zero4", "strategy"),
                                              ("trainer.max_steps=abc", "trainer.max_steps"),
                                              ("model.size=huge", "model.size"),
                                              ("trainer.max_stepz=3", "max_stepz"),
                                              ("strategy.zero.bucket_numl=5", "bucket_numl")])
def test_wrong_override_names_the_key(override: str, key: str, tmp_path: Path) -> None:
    run = run_train(override, "--cfg", "job", cwd=tmp_path)
    assert run.returncode != 0 and key in run.stderr + run.stdout


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    return fast_sweep(tmp_path_factory.mktemp("sweep"))


def test_fast_sweep_writes_report(sweep: tuple[Path, subprocess.CompletedProcess]) -> None:
    sweep, run = sweep
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    for name in ("report.md", "report.csv", "report.png"):
        assert (sweep / name).stat().st_size > 0
    with open(sweep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["strategy"] for r in rows] == ["ddp", "fsdp", "zero3"]
    for r in rows:  # every measured column measured for the anchor (fsdp) as for ours
        assert float(r["samples_per_s"]) > 0 and float(r["comm_mib_per_step"]) > 0
        assert float(r["peak_rss_mib"]) > 0
        assert float(r["model_state_mib"]) == pytest.approx(float(r["predicted_mib"]), rel=0.05)
        assert float(r["train_loss"]) < float(r["first_loss"])
        assert float(r["val_loss"]) > 0
    table = [ln for ln in (sweep / "report.md").read_text().splitlines() if ln.startswith("| ")]
    assert len(table) == 4 and not any("not measured" in ln for ln in table)
    ddp, fsdp, zero3 = rows
    for r in rows:  # read from the run (the request agreed here: nothing listed as changed)
        assert r["precision"] == "32-true" and r["world_size"] == "2"
    assert "did not run as requested" not in (sweep / "report.md").read_text()
    for m in (json.loads(p.read_text()) for p in sweep.glob("*/metrics.json")):
        # max_steps=6, val_check_interval=4: validated at 4 by Lightning, at 6 after fit
        assert m["val_step"] == m["steps"] == 6, m
        assert m["requested"]["precision"] == m["precision"] == "32-true"
    assert float(zero3["model_state_mib"]) < 0.6 * float(ddp["model_state_mib"])
    # FSDP's full sharding holds what stage 3 holds (its flat shards, counted from them)
    assert float(fsdp["model_state_mib"]) == pytest.approx(float(zero3["model_state_mib"]),
                                                           rel=0.05)
    # identical data and initial weights: the first loss is the same under every strategy,
    # and the losses track each other (fp32, same updates up to reduction order)
    for r in (fsdp, zero3):
        assert float(r["first_loss"]) == pytest.approx(float(ddp["first_loss"]), rel=1e-5)
        assert float(r["val_loss"]) == pytest.approx(float(ddp["val_loss"]), rel=1e-4)
    # The process-group counter that measures DDP and FSDP agrees with the engine's own
    # count on the zero3 job, collective by collective (one byte model, every call seen).
    jobs = {m["strategy"]: m for m in (json.loads(p.read_text())
                                       for p in sweep.glob("*/metrics.json"))}
    assert jobs["zero3"]["comm_bytes_per_step_pg"] == pytest.approx(
        jobs["zero3"]["comm_bytes_per_step"], rel=1e-3)
    # DDP all-reduces every gradient once: 2 (N-1)/N x 4 bytes x parameters at N=2
    assert jobs["ddp"]["comm_bytes_per_step"] == pytest.approx(4 * jobs["ddp"]["num_params"],
                                                               rel=0.01)
    assert run.stdout.count("processes: ") == 3, "each job must run exactly once"
    assert "--max-restarts 3" in run.stdout, "workers start with restarts enabled"


def test_floor_is_overlapped_communication_or_compute_plus_the_optimizer() -> None:
    from bench import floor

    parts = {"fwd_bwd": 1.0, "adamw_full": 0.4, "adamw_shard": 0.2, "all_gather": 0.3,
             "reduce_scatter": 0.5, "all_reduce": 1.5, "params": 10}
    # stage 0: all-reduce 1.5 > compute; 1-2: RS + AG = 0.8 < compute; 3: 2 AG + RS = 1.1
    assert floor.floors(parts) == pytest.approx({0: 1.9, 1: 1.2, 2: 1.2, 3: 1.3})


@pytest.mark.parametrize(("overrides", "named"), [
    (["precision.name=bf17"], "precision.name='bf17'"),
    (["optim.name=lion"], "optim.name='lion'"),
    (["+strategy.zero.bucket_numl=5"], "bucket_numl"),  # "+" adds keys past the schema
    (["strategy=zero2", "strategy.zero.unit_numel=5"], "unit_numel"),  # stage 3 only
    # A real Optuna study (one trial): the trial is recorded as failed with the reason, and
    # the study stops with that error (no NaN reaching Optuna).
    (["hparams_search=optuna", "trainer.limit_val_batches=0", "hydra.sweeper.n_trials=1"],
     "Failed experiment: optimized_metric='val_loss' needs validation, but "
     "trainer.limit_val_batches=0 runs none"),
])
def test_bad_job_values_fail_before_any_worker_starts(overrides: list[str], named: str,
                                                      tmp_path: Path) -> None:
    run = run_train(*overrides, *FAST, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and named in out, out[-2000:]
    assert "processes:" not in out, "a worker was started before the check"


def test_schema_lists_every_zero_config_option() -> None:
    import dataclasses

    import zero_strategy as zs

    fields = {f.name for f in dataclasses.fields(zs.ZeroConfig)} - {"stage", "precision"}
    assert set(schema.ZERO_OPTIONS) == fields


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_optim_muon_trains_hidden_matrices_with_muon_and_the_rest_with_adamw(name: str) -> None:
    import torch

    import zero_strategy as zs
    from recipes.models import RecipeModule

    cfg = compose_config([f"model={name}", "model.size=tiny", "optim=muon"])
    module = RecipeModule(dict(cfg.model), dict(cfg.optim), vocab_size=64, max_steps=10)
    configured = module.configure_optimizers()
    opt, sched = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert isinstance(opt, zs.CombinedOptimizer)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in module.model.named_parameters()}
    on_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    on_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert on_muon and on_muon.isdisjoint(on_adamw)
    assert on_muon | on_adamw == set(names.values()), "every parameter in one optimizer"
    for n in on_muon:  # hidden 2-D weights only: no embedding, norm, bias or output head
        assert not any(k in n for k in ("embed", "wte", "wpe", "bias", "ln", "LayerNorm",
                                        "classifier", "lm_head", "decoder")), n
    hidden = {"gpt": "h.0.mlp.c_fc.weight", "bert": "encoder.layer.0.intermediate.dense.weight"}
    assert any(n.endswith(hidden[name]) for n in on_muon), sorted(on_muon)
    opt.step()  # no gradients yet: nothing moves; lets the scheduler step without a warning
    for _ in range(6):
        sched.step()
    factor = adamw.param_groups[0]["lr"] / cfg.optim.lr
    assert factor < 1, "the cosine schedule has started"
    assert muon.param_groups[0]["lr"] == pytest.approx(cfg.optim.muon_lr * factor), \
        "one schedule drives both optimizers"


def test_optim_muon_on_a_model_without_2d_hidden_weights_says_so() -> None:
    from recipes.models import RecipeModule

    cfg = compose_config(["model=resnet", "model.size=tiny", "optim=muon"])
    module = RecipeModule(dict(cfg.model), dict(cfg.optim), vocab_size=64, max_steps=10)
    with pytest.raises(ValueError, match="no hidden 2-D weights for Muon"):
        module.configure_optimizers()


def test_bytes_per_step_leave_out_only_what_was_counted() -> None:
    """A validation after training (the final model's) sends bytes after the per-step
    figure's end was read: leaving them out anyway made the figure negative (-1.84 MiB for
    zero3 in a 5-step sweep)."""
    from types import SimpleNamespace

    from recipes.metrics import WARMUP_STEPS, JobMetrics

    class Engine:
        total = 0

        def comm_bytes(self) -> dict[str, int]:
            return {"total": self.total}

    engine = Engine()
    trainer = SimpleNamespace(strategy=SimpleNamespace(engine=engine), global_step=0,
                              world_size=2, callback_metrics={})
    metrics = JobMetrics(cfg=None, out=Path("."))
    metrics.outside_training_start(trainer)  # the sanity check, before counting starts
    engine.total += 7
    metrics.outside_training_end(trainer)
    trainer.global_step = WARMUP_STEPS
    metrics.on_train_batch_start(trainer, None, None, 0)  # counting starts here
    engine.total += 1000  # two training steps
    metrics.outside_training_start(trainer)  # a periodic validation: left out
    engine.total += 300
    metrics.outside_training_end(trainer)
    engine.total += 1000
    metrics.on_train_end(trainer, None)
    metrics.outside_training_start(trainer)  # the final validation, after the end was read
    engine.total += 500
    metrics.outside_training_end(trainer)
    assert metrics._comm_per_step(trainer, 2)[0] == 1000


def _square_mlp() -> object:
    """A LightningModule training an MLP on the square of its output (Lightning is imported
    only by the tests that fit)."""
    import lightning as L

    from tests.support.models import MLP

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP()

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            return self.net(batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


@pytest.mark.parametrize(("limits", "title"), [({"max_steps": 2}, "Epoch 0 · 2 steps"),
                                               ({"max_epochs": 1}, "Epoch 0/0")],
                         ids=["max_steps", "max_epochs"])
def test_progress_bar_titles_a_step_limited_run_without_a_negative_epoch_total(
        limits: dict, title: str) -> None:
    """Lightning's own bar read ``Epoch 0/-2`` in a job limited by steps (README command 1).
    The titles come from a real fit, so a Lightning that stops asking the bar for its title
    fails here instead of the old title coming back unnoticed."""
    import lightning as L
    from torch.utils.data import DataLoader

    from recipes.console import StepProgressBar

    class Recorded(StepProgressBar):
        titles: list[str] = []

        def _get_train_description(self, current_epoch: int) -> str:
            self.titles.append(super()._get_train_description(current_epoch).strip())
            return self.titles[-1]

    bar = Recorded()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[bar], **limits)
    trainer.fit(_square_mlp(), DataLoader(torch.randn(4, 16), batch_size=2))
    assert bar.titles and set(bar.titles) == {title}


def test_a_job_resumed_after_its_last_step_reports_its_peak(tmp_path: Path) -> None:
    """A job requeued after it saved its last step resumes at max_steps and trains nothing:
    Lightning skips on_train_start, where the peak's base was taken, and the job's record
    failed (AttributeError: 'JobMetrics' object has no attribute 'base_rss'; SLURM test,
    2026-11-30). The resume is a real Lightning fit."""
    import lightning as L
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader

    from recipes.metrics import JobMetrics

    class Started(L.Callback):
        calls: list[str] = []

        def on_train_start(self, *_: object) -> None:
            self.calls.append("train_start")

    def fit(ckpt: Path | None) -> tuple[L.Trainer, JobMetrics]:
        # what the record reads of the job's config (the activation formula's inputs)
        cfg = OmegaConf.create({"model": {"name": "mlp", "seq_len": 16},
                                "data": {"batch_size": 2}})
        metrics = JobMetrics(cfg=cfg, out=tmp_path / "metrics.json")
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, max_steps=2,
                            enable_checkpointing=False, enable_model_summary=False,
                            enable_progress_bar=False, callbacks=[Started(), metrics])
        trainer.fit(_square_mlp(), DataLoader(torch.randn(4, 16), batch_size=2), ckpt_path=ckpt)
        return trainer, metrics

    trainer, _ = fit(None)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    Started.calls.clear()
    resumed, metrics = fit(tmp_path / "last.ckpt")
    assert resumed.global_step == 2 and Started.calls == [], "the resume trained: no premise"
    record = metrics._rank_record(resumed, resumed.lightning_module)
    assert 0 <= record["peak_rss_mib"] < 1024, record["peak_rss_mib"]


def test_a_job_prints_lightnings_log_lines_once_and_no_tip() -> None:
    """In a worker, Lightning keeps a console handler of its own (imported before logging was
    configured) while Hydra's root handler also gets its records: each line came twice."""
    import io
    import logging

    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    from recipes.console import quiet_console

    root_out, own_out = io.StringIO(), io.StringIO()
    root_handler, own_handler = logging.StreamHandler(root_out), logging.StreamHandler(own_out)
    lightning = logging.getLogger("lightning")  # where the unified package puts its handler
    saved = (lightning.handlers[:], lightning.propagate)
    logging.getLogger().addHandler(root_handler)
    lightning.addHandler(own_handler)
    try:
        quiet_console()
        rank_zero_info("GPU available: False, used: False")
        rank_zero_info("💡 Tip: For seamless cloud logging ...")
    finally:
        logging.getLogger().removeHandler(root_handler)
        lightning.handlers[:], lightning.propagate = saved
    assert root_out.getvalue() == "GPU available: False, used: False\n"
    assert own_out.getvalue() == ""
