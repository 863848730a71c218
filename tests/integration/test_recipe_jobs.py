"""Recipe jobs that continue, restart or follow other jobs: a worker killed mid-run restarts
from its checkpoint to the uninterrupted weights, DeepSpeed ZeRO-3 measured on the sweep's
work, and jobs of ours continuing DeepSpeed's, FSDP's and our own checkpoints. Each is a real
2-process job started as a user starts one (``python recipes/train.py``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.recipe_runs import FAST, fast_sweep, needs_deepspeed, run_train


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    return fast_sweep(tmp_path_factory.mktemp("sweep"))


def test_killed_worker_restarts_and_ends_with_the_uninterrupted_weights(
        sweep: tuple[Path, subprocess.CompletedProcess], tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed right after step 5 (as a lost node would be); torch.distributed.run
    restarts both workers, which resume from the step-4 checkpoint and finish with weights
    bit-identical to the sweep's uninterrupted zero3 job."""
    job = tmp_path / "job"
    run = run_train("strategy=zero3", *FAST, "trainer.checkpoint_every=2", f"hydra.run.dir={job}",
               cwd=tmp_path, env={"ZS_FAULT_KILL_STEP": "5", "ZS_FAULT_KILL_RANK": "1"})
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    # The agent reports the SIGKILL as a script's exit code, or (workers forked from the
    # preloaded Hydra process, recipes/agent.py) as the signal that ended the process.
    # Forked workers: rank 0's collective fails first when rank 1 dies, and the agent may
    # report that exception rather than the signal.
    killed = any(k in log for k in ("exitcode: -9", "SIGKILL", "ProcessExitedException",
                                    "ProcessRaisedException"))
    assert killed and "Restoring states from the checkpoint" in log, log[-4000:]
    sweep_dir, _ = sweep
    reference = next(m for m in (json.loads(p.read_text()) for p in sweep_dir.glob(
        "*/metrics.json")) if m["strategy"] == "zero3")
    resumed = json.loads((job / "metrics.json").read_text())
    assert resumed["steps"] == reference["steps"] == 6
    assert resumed["weights_sha256"] == reference["weights_sha256"]
    assert resumed["train_loss"] == reference["train_loss"]


@pytest.fixture(scope="module")
def ds3_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSpeed ZeRO-3 job on the sweep's work, checkpointing every 2 steps; its step-4
    checkpoint is kept (a test seam) for a job of ours to continue from."""
    tmp_path = tmp_path_factory.mktemp("ds3")
    job = tmp_path / "ds3"
    run = run_train("strategy=deepspeed_stage_3", *FAST, "trainer.checkpoint_every=2",
               f"hydra.run.dir={job}", cwd=tmp_path, env={"ZS_CHECKPOINT_COPY_AT": "4"})
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return job


@needs_deepspeed
def test_deepspeed_stage_3_job_matches_the_sweep_and_is_measured(
        sweep: tuple[Path, subprocess.CompletedProcess], ds3_job: Path) -> None:
    """One DeepSpeed ZeRO-3 job on the sweep's work: same first loss (same data and initial
    weights), the model states it holds counted (its fp32 master partitions on top of the
    formula's, so at or above it), bytes sent measured and non-zero, what ran read from it."""
    sweep_dir, _ = sweep
    ds = json.loads((ds3_job / "metrics.json").read_text())
    zero3 = next(m for m in (json.loads(p.read_text()) for p in sweep_dir.glob(
        "*/metrics.json")) if m["strategy"] == "zero3")
    assert (ds["strategy"], ds["stage"], ds["precision"], ds["optim"]) == (
        "deepspeed_stage_3", 3, "32-true", "adamw")
    assert ds["first_loss"] == pytest.approx(zero3["first_loss"], rel=1e-5)
    assert ds["train_loss"] == pytest.approx(zero3["train_loss"], rel=1e-3)
    assert ds["comm_bytes_per_step"] > 0
    for r in ds["ranks"]:
        assert r["model_state_bytes"] >= 0.99 * r["predicted_bytes"]
        assert r["model_state_by_kind"]["params"] > 0 and r["model_state_by_kind"]["optim"] > 0


@needs_deepspeed
def test_zero3_job_continues_a_deepspeed_job(ds3_job: Path, tmp_path: Path) -> None:
    """The sweep-then-switch workflow: ``strategy=zero3 trainer.resume_from=<DeepSpeed
    checkpoint>`` resumes DeepSpeed's step-4 state (fp32 masters, Adam moments and steps,
    the lr schedule, Lightning's loops and the data position) and ends where DeepSpeed's own
    uninterrupted job ended. Tolerance: fp32 on both sides, the same AdamW on the same
    masters; the gradients differ by reduction order only (a few ulps), so after 2 steps the
    losses agree to ~1e-6 relative (argued in tests/integration/test_foreign_checkpoints.py)."""
    job = tmp_path / "switched"
    source = ds3_job / "checkpoints" / "at-step-4"
    assert (source / "latest").read_text().strip() == "checkpoint"  # Lightning's DS layout
    run = run_train("strategy=zero3", *FAST, f"trainer.resume_from={source}",
               f"hydra.run.dir={job}", cwd=tmp_path)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "Restoring states from the checkpoint" in log
    ds = json.loads((ds3_job / "metrics.json").read_text())
    ours = json.loads((job / "metrics.json").read_text())
    assert ours["strategy"] == "zero3" and ours["steps"] == ds["steps"] == 6
    assert ours["train_loss"] == pytest.approx(ds["train_loss"], rel=1e-5)
    assert ours["val_loss"] == pytest.approx(ds["val_loss"], rel=1e-5)


def test_zero3_job_continues_an_fsdp_job(sweep: tuple[Path, subprocess.CompletedProcess],
                                        tmp_path: Path) -> None:
    """``trainer.resume_from`` on the sweep's fsdp job (Lightning's FSDPStrategy writes its
    sharded state as a DCP directory with Lightning's ``meta.pt``): a zero3 job continues
    from step 4 and ends on FSDP's own train and val loss (same tolerance as above)."""
    sweep_dir, _ = sweep
    fsdp_job = next(p.parent for p in sweep_dir.glob("*/metrics.json")
                    if json.loads(p.read_text())["strategy"] == "fsdp")
    source = fsdp_job / "checkpoints" / "at-step-4"
    assert (source / ".metadata").is_file() and (source / "meta.pt").is_file()
    job = tmp_path / "switched"
    # quoted: the sweep's job directory names hold '=' and ',' (Hydra's override grammar)
    run = run_train("strategy=zero3", *FAST, f"trainer.resume_from='{source}'",
               f"hydra.run.dir={job}", cwd=tmp_path)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    fsdp = json.loads((fsdp_job / "metrics.json").read_text())
    ours = json.loads((job / "metrics.json").read_text())
    assert ours["steps"] == fsdp["steps"] == 6
    assert ours["train_loss"] == pytest.approx(fsdp["train_loss"], rel=1e-5)
    assert ours["val_loss"] == pytest.approx(fsdp["val_loss"], rel=1e-5)


def test_resume_from_names_the_option_when_it_is_no_checkpoint(tmp_path: Path) -> None:
    run = run_train("strategy=zero3", *FAST, f"trainer.resume_from={tmp_path}", cwd=tmp_path)
    assert run.returncode != 0
    assert f"trainer.resume_from='{tmp_path}'" in run.stdout + run.stderr


def test_zero3_disk_job_continues_the_zero3_job(sweep: tuple[Path, subprocess.CompletedProcess],
                                              tmp_path: Path) -> None:
    """``strategy=zero3_disk`` with ``strategy.zero.offload_dir``: the sweep's zero3 job's
    step-4 checkpoint loads into the disk tier, which trains to step 6 with the zero3 job's
    own losses, bit for bit (the same arithmetic; only where the states rest differs), and
    leaves nothing in offload_dir."""
    sweep_dir, _ = sweep
    zero3_job = next(p.parent for p in sweep_dir.glob("*/metrics.json")
                     if json.loads(p.read_text())["strategy"] == "zero3")
    source, offload, job = zero3_job / "checkpoints" / "at-step-4", tmp_path / "ssd", tmp_path / "j"
    run = run_train("strategy=zero3_disk", f"strategy.zero.offload_dir={offload}", *FAST,
               f"trainer.resume_from='{source}'", f"hydra.run.dir={job}", cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    zero3 = json.loads((zero3_job / "metrics.json").read_text())
    ours = json.loads((job / "metrics.json").read_text())
    assert ours["strategy"] == "zero3_disk" and ours["steps"] == zero3["steps"] == 6
    assert ours["train_loss"] == zero3["train_loss"] and ours["val_loss"] == zero3["val_loss"]
    assert not [p for p in offload.iterdir() if p.is_dir()], "each rank removes its files"




def test_checkpointed_job_continues_the_zero3_job(sweep: tuple[Path, subprocess.CompletedProcess],
                                                 tmp_path: Path) -> None:
    """The Hydra option: ``strategy.zero.activation_checkpointing=true`` with the layers'
    inputs on disk continues the sweep's zero3 job from step 4 to 6 with its losses. The
    recomputation runs the same kernels on the same inputs (dropout 0 in the recipe's model),
    so the arithmetic is the same: equal to the last bit."""
    sweep_dir, _ = sweep
    zero3_job = next(p.parent for p in sweep_dir.glob("*/metrics.json")
                     if json.loads(p.read_text())["strategy"] == "zero3")
    source, offload, job = zero3_job / "checkpoints" / "at-step-4", tmp_path / "ssd", tmp_path / "j"
    run = run_train("strategy=zero3", "strategy.zero.activation_checkpointing=true",
                    "strategy.zero.offload_activations=disk",
                    f"strategy.zero.offload_dir={offload}", *FAST,
                    f"trainer.resume_from='{source}'", f"hydra.run.dir={job}", cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    zero3 = json.loads((zero3_job / "metrics.json").read_text())
    ours = json.loads((job / "metrics.json").read_text())
    assert ours["steps"] == zero3["steps"] == 6
    assert ours["train_loss"] == zero3["train_loss"] and ours["val_loss"] == zero3["val_loss"]
    assert not [p for p in offload.iterdir() if p.is_dir()], "each rank removes its files"
