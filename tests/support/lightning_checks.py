"""The checks of one Lightning preset against DDP's run, shared by both tiers: each test module
that imports them gives ``name`` its presets (``pytest_generate_tests``) and a ``suite``
fixture with the results of tests/worlds/lightning_run.py (quick: the stage-3 presets;
integration: every other one)."""

from __future__ import annotations

import pytest

from tests.worlds.lightning_launch import check

TOL = 1e-5  # fp32: only summation order differs from DDP
NUM_PARAMS = 4163  # tests.support.models.MLP


def test_matches_ddp(suite: dict, name: str) -> None:
    """Per-step losses, LR schedule, final consolidated weights; accumulation 2, clip 1.0."""
    refs = check(suite["ddp"])
    for rank, (r, ref) in enumerate(zip(check(suite[name]), refs)):
        assert len(r["loss"]) == len(ref["loss"]) == 16
        for i, (a, b) in enumerate(zip(r["loss"], ref["loss"])):
            assert a == pytest.approx(b, rel=TOL, abs=1e-7), f"rank {rank} micro-batch {i}"
        assert r["lr"] == ref["lr"] and len(set(ref["lr"])) == 3, "LR schedule differs"
        assert r["rel_vs_ddp"] <= TOL, f"rank {rank}: weights differ by {r['rel_vs_ddp']:.2e}"
        assert r["moved"] > 1e-3, "training did not move the weights: parity would be vacuous"
        assert min(ref["ref_norm"]) > 1.0, "clipping at 1.0 never engaged"
        assert r["stage"] == (1 if name == "zero1" else 2 if name.startswith("zero2") else 3)


def test_accumulation_skips_gradient_communication(suite: dict, name: str) -> None:
    for r in check(suite[name]):
        assert r["reduce"][0::2] == [0] * 8, "a non-final micro-batch reduced gradients"
        assert all(b > 0 for b in r["reduce"][1::2]), "the final micro-batch did not reduce"


def test_log_validate_test_predict_and_summary(suite: dict, name: str) -> None:
    refs = check(suite["ddp"])
    for r, ref in zip(check(suite[name]), refs):
        assert r["summary"] == {"total": NUM_PARAMS, "trainable": NUM_PARAMS}
        assert r["logged"] == pytest.approx(ref["logged"], rel=TOL)  # self.log(sync_dist=True)
        assert r["val"] == pytest.approx(ref["val"], rel=TOL)
        assert r["test"] == pytest.approx(ref["test"], rel=TOL)
        assert r["pred"] == pytest.approx(ref["pred"], rel=TOL, abs=1e-5)


def test_resume_from_model_checkpoint_is_exact(suite: dict, name: str) -> None:
    """ModelCheckpoint wrote sharded directories; a new Trainer resumes the same model object
    from step 4 and reproduces steps 5-8 of the uninterrupted run."""
    for r in check(suite[name]):
        assert r["saved"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
        n = len(r["resume_loss"])
        assert n == 8 and r["resume_step"][0] == 4
        assert r["resume_loss"] == pytest.approx(r["loss"][-n:], rel=TOL, abs=1e-7)
        assert r["resume_lr"] == r["lr"][-n:], "LR schedule not restored"
        assert r["resume_rel"] <= TOL


def test_checkpoint_after_fit_evaluates_and_consolidates(suite: dict, name: str) -> None:
    results = check(suite[name])
    for r in results:
        assert r["final_is_dir"], "trainer.save_checkpoint did not write a sharded directory"
        assert r["ckpt_test"] == pytest.approx(r["test"], rel=TOL), "test(ckpt_path=) differs"
    rank0 = results[0]
    assert rank0["consolidated_rel"] == 0.0, "load_from_checkpoint weights differ"
    assert rank0["safetensors_rel"] == 0.0, "zero_strategy.write_consolidated weights differ"
    assert rank0["consolidated_hparams"] == {"lr": 0.01, "seed": 0}
    assert {"state_dict", "hyper_parameters", "pytorch-lightning_version"} <= set(
        rank0["consolidated_keys"])


def test_load_from_checkpoint_on_the_path_model_checkpoint_reports(suite: dict,
                                                                  name: str) -> None:
    """``MLPModule.load_from_checkpoint(saver.best_model_path)`` on the sharded directory
    (rank 0 alone, mid-world): the engine's consolidated weights bit for bit, the hparams."""
    rank0 = check(suite[name])[0]
    assert rank0["best_model_path"] == "epoch=1-step=8.ckpt"  # the last save: the final weights
    assert rank0["best_rel"] == 0.0, "load_from_checkpoint weights differ from the engine's"
    assert rank0["best_hparams"] == {"lr": 0.01, "seed": 0}


def parametrize_presets(metafunc: pytest.Metafunc, presets: tuple[str, ...]) -> None:
    """``pytest_generate_tests`` of a module that imports these checks: each takes ``name``
    from ``presets``, unless the test parametrizes ``name`` itself."""
    own = any(m.args and m.args[0] == "name"
              for m in metafunc.definition.iter_markers("parametrize"))
    if "name" in metafunc.fixturenames and not own:
        metafunc.parametrize("name", presets)
