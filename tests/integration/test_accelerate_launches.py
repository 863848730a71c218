"""Accelerate end to end, every shipped plugin file: real ``accelerate launch`` runs on 2 CPU
processes against plain Accelerate DDP running the same loop. ZeRO stages 1-3, stage 3 with
offload and with the disk tier, each a full run that saves its state half-way, then
relaunched from that state. A GPT-2 with dropout on a shuffled loader at stage 3, saved after
6 of 12 steps and resumed, its final model exported with ``save_model`` and reloaded with
``from_pretrained``. Muon beside AdamW prepared together at stage 2
(tests/worlds/accelerate_optimizers.py). A worker killed mid-run under ``--max_restarts``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import accelerate_checks as A
from tests.support import several_optimizers as so
from tests.support.accelerate_checks import ACCUM, GPT2, GPT2_SAVE_AT, GPT2_STEPS, STEPS, VARIANTS
from tests.support.harness import ROOT
from tests.worlds.accelerate_launch import CONF, Job, Outcome, run_jobs
from zero_strategy.accelerate import CONFIG_ENV


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("accelerate")


@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, Outcome]:
    """Every launch of the module: full runs (the ZeRO ones save at SAVE_AT), each ZeRO variant
    resumed from its saved state, the GPT-2 pair and the killed run."""
    # First: the GPT-2 pair is the longest chain (transformers' import is most of each launch).
    gpt2_env, gpt2_ckpt = {CONFIG_ENV: str(CONF / "zero3.yaml")}, str(work / "gpt2-ckpt")
    jobs = [Job("gpt2", [*GPT2, "--save-at", str(GPT2_SAVE_AT), "--save-dir", gpt2_ckpt,
                         "--export-dir", str(work / "gpt2-export")], work / "gpt2", env=gpt2_env),
            Job("gpt2-resumed", [*GPT2, "--resume", gpt2_ckpt], work / "gpt2-resumed",
                env=gpt2_env, after="gpt2"),
            A.ddp_job(work),
            Job("optimizers", [], work / "optimizers",
                script=ROOT / "tests" / "worlds" / "accelerate_optimizers.py")]
    for name in VARIANTS:
        jobs += A.variant_jobs(work, name, resume=True)
    # Rank 1 SIGKILLed after step 5 of a run checkpointing every 2 steps, launched with
    # restarts: the relaunched workers resume from step 4 (tests fault tolerance).
    jobs.append(Job("zero3-killed", [*A.COMMON, *A.SMALL_UNITS, "--checkpoint-every", "2",
                                     "--checkpoint-dir", str(work / "zero3-killed-ckpt")],
                    work / "zero3-killed", launch_args=["--max_restarts", "1"],
                    env={CONFIG_ENV: str(CONF / "zero3.yaml"), "ZS_FAULT_KILL_STEP": "5"}))
    return run_jobs(jobs)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_launch_is_distributed_and_overrides_reach_the_engine(runs: dict[str, Outcome],
                                                              name: str) -> None:
    A.assert_launched_distributed(runs[name])
    A.assert_overrides_reached_the_engine(runs[name], name)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_plain_accelerate_ddp(runs: dict[str, Outcome], name: str) -> None:
    A.assert_matches_ddp(runs["ddp"], runs[name], name)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_resume_equals_uninterrupted_run(runs: dict[str, Outcome], name: str) -> None:
    A.assert_resume_equals_uninterrupted(runs[name], runs[f"{name}-resumed"], name)


def test_resume_with_dropout_and_a_shuffled_loader_is_bit_exact(
        runs: dict[str, Outcome]) -> None:
    """The documented resume (load_state, then skip_first_batches for the rest of the epoch)
    repeats the uninterrupted run's batches and dropout masks: equal losses and weights, bit for
    bit. Plain Accelerate's skipped loader draws one number from the global generator after
    load_state restored it, shifting every later dropout mask on CPU; ZeroAccelerator's does
    not (``skip_first_batches``)."""
    full, again = A.ok(runs["gpt2"]), A.ok(runs["gpt2-resumed"])
    for a, b in zip(full, again):
        assert b["start_step"] == GPT2_SAVE_AT and b["steps"] == GPT2_STEPS
        assert b["losses"] == a["losses"][GPT2_SAVE_AT:]
        assert b["lrs"] == a["lrs"][GPT2_SAVE_AT:]
    assert again[0]["weights"] == full[0]["weights"]
    assert again[0]["eval_loss"] == full[0]["eval_loss"]


def test_save_model_and_from_pretrained_give_the_trained_weights(
        runs: dict[str, Outcome], work: Path) -> None:
    """Stage 3, sharded parameters: ``accelerator.save_model`` writes the consolidated
    weights (safetensors; the tied ``lm_head.weight`` once, as Accelerate does), the config
    beside them makes a ``from_pretrained`` folder, and ``GPT2LMHeadModel.from_pretrained``
    gives exactly the weights ``accelerator.get_state_dict`` returned."""
    from safetensors.torch import load_file

    rank0 = A.ok(runs["gpt2"])[0]
    assert rank0["zero_config"]["stage"] == 3
    export = rank0["export"]
    assert export["files"] == ["config.json", "model.safetensors"]
    assert export["keys_equal"] and export["max_abs_diff"] == 0.0, export
    saved = load_file(str(work / "gpt2-export" / "model.safetensors"))
    assert set(saved) == set(rank0["weights"]) - {"lm_head.weight"}
    for key, tensor in saved.items():
        assert tensor.flatten().tolist() == rank0["weights"][key], key


def test_several_optimizers_match_single_process_training(runs: dict[str, Outcome]) -> None:
    """``prepare(model, muon, adamw, scheduler)``: one engine step per optimizer step (the
    second part's ``step()`` takes its turn), the weights of one process training on the global
    batch, the scheduler changing the Muon part's lr only, each wrapper's ``state_dict()`` its
    own part's (tolerance: so.TOL)."""
    for r in A.ok(runs["optimizers"]):
        assert r["engine_steps"] == so.STEPS
        assert r["rel"] <= so.TOL, f"weights differ from single-process training by {r['rel']}"
        assert r["moved"] > 1e-2
        # Accelerate steps the scheduler once per process (2) at each optimizer step.
        assert r["lr"] == [[so.MUON_LR * so.muon_factor(2 * i), so.ADAMW_LR]
                           for i in range(so.STEPS)]
        muon, adamw = r["part_states"]
        assert list(muon) == ["0", "1", "2"] and all(k == ["momentum_buffer"]
                                                     for k in muon.values())
        assert len(adamw) == 9 and all(k == ["exp_avg", "exp_avg_sq", "step"]
                                       for k in adamw.values())


def test_several_optimizers_double_step_and_state_round_trip(runs: dict[str, Outcome]) -> None:
    """Muon stepped twice after one backward is refused; ``load_state`` restores both parts'
    weights, states and lrs exactly: the step replayed after it (AdamW first) gives the same
    weights as the step before it."""
    for r in A.ok(runs["optimizers"]):
        assert "optimizer 0 (Fp32Muon) was stepped twice without a backward" in r["double_step"]
        assert r["loaded_lr"] == [so.MUON_LR * so.muon_factor(2 * so.STEPS), so.ADAMW_LR]
        assert r["loaded_rel"] == 0.0 and r["replayed_rel"] == 0.0


def test_killed_worker_restarts_and_ends_with_the_uninterrupted_weights(
        runs: dict[str, Outcome]) -> None:
    """``accelerate launch --max_restarts 1``: rank 1 dies after step 5, the launcher restarts
    both workers, which resume from the step-4 checkpoint (the newest complete one) and end
    with the uninterrupted zero3 run's weights, bit for bit."""
    killed, full = runs["zero3-killed"], A.ok(runs["zero3"])
    assert "exitcode: -9" in killed.log, killed.log[-4000:]
    again = A.ok(killed)
    for a, b in zip(full, again):
        assert b["start_step"] == 4 and b["steps"] == STEPS
        assert b["losses"] == a["losses"][4 * ACCUM:]
    assert again[0]["weights"] == full[0]["weights"]
