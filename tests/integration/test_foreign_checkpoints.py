"""Resuming other systems' checkpoints with their optimizer: DeepSpeed ZeRO stage 3 written
on 2 ranks continues under our stage 2 on 3 ranks, FSDP2's DCP checkpoint written on 2 ranks
under our stage 3 on 1 rank; each against the anchor's own uninterrupted run.

Tolerance. Everything is fp32 and the arithmetic after loading is the same on both sides
(torch's AdamW on the same masters and moments); what differs is how a gradient is summed:
the anchor adds 2 ranks' partial means, we add 3 (or 1) of different row groups, so each
gradient element differs by a few ulps of the addends, |dg| <= ~4 eps32 |g| (eps32 = 1.2e-7).
Through Adam's m / sqrt(v) that is a relative change of the same order in each update of
size <= lr = 1e-2, so after M = 3 steps a weight moves at most 3 * 1e-2 * 4 * 1.2e-7 ~ 1.5e-8
from the anchor's, far below 1e-6 except where v is tiny and the division amplifies: an
element whose gradients are ~eps (Adam's eps = 1e-8) can differ by up to a full lr step
relative to its size. No such element exists in this model (the smallest |g| is ~1e-4, see
the check below), so weights are compared at 1e-6 absolute and the losses, sums of 30
squared errors of size ~1, at 1e-6 relative.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.harness import ROOT, check, run_world
from zero_strategy.checkpoint.read import consolidate, open_reader

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _torchrun(*args: str, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(ROOT / "tests" / "worlds" / "foreign_run.py"), *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The anchors' checkpoints and uninterrupted runs, then our resumed runs."""
    root = tmp_path_factory.mktemp("foreign")
    sources = []
    if HAVE_DEEPSPEED:
        (root / "ds3").mkdir()
        _torchrun("deepspeed", str(root / "ds3"), "3", cwd=root)
        sources.append(("ds3", 3, 2))  # written at ZeRO-3 on 2 ranks, read at our stage 2, N=3
    (root / "fsdp2").mkdir()
    _torchrun("fsdp2", str(root / "fsdp2"), cwd=root)
    sources.append(("fsdp2", 1, 3))  # written by FSDP2 on 2 ranks, read at stage 3, N=1
    for name, world, stage in sources:
        results = run_world("tests/worlds/scenarios_foreign.py", world, env={
            "ZS_FOREIGN_ROOT": str(root), "ZS_FOREIGN_SOURCES": f"{name}:{stage}"})
        out = check(results[f"resume_{name}"])[0]
        (root / name / "ours.json").write_text(json.dumps(out))
    return root


@pytest.fixture(scope="module")
def ours_to_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ours at stage 3 on 2 ranks, checkpoint at step K converted with ``zero-strategy
    convert --to dcp``, FSDP2 on 2 ranks continuing from it; beside ours uninterrupted."""
    root = tmp_path_factory.mktemp("to_fsdp2")
    out = check(run_world("tests/worlds/scenarios_foreign.py", 2, env={
        "ZS_FOREIGN_ROOT": str(root), "ZS_FOREIGN_OURS": "3"})["uninterrupted"])[0]
    (root / "ours.json").write_text(json.dumps(out))
    run = subprocess.run([sys.executable, "-m", "zero_strategy.cli", "convert",
                          str(root / "ours" / "at3"), str(root / "dcp"), "--to", "dcp"],
                         capture_output=True, text=True, cwd=root)
    assert run.returncode == 0, run.stderr
    (root / "fsdp2").mkdir()
    _torchrun("fsdp2-resume", str(root / "fsdp2"), str(root / "dcp"), cwd=root)
    return root


def test_ours_converted_to_dcp_continues_under_fsdp2(ours_to_fsdp2: Path) -> None:
    """Same tolerance argument as above (fp32, the same AdamW, 2 ranks on both sides)."""
    ours = json.loads((ours_to_fsdp2 / "ours.json").read_text())
    fsdp_losses = json.loads((ours_to_fsdp2 / "fsdp2" / "losses.json").read_text())
    final = torch.load(ours_to_fsdp2 / "fsdp2" / "final.pt", weights_only=True)
    assert final["lr"] == 1e-2  # the hyperparameters came through DCP's param_groups
    assert fsdp_losses == pytest.approx(ours["losses"], rel=1e-6)
    assert set(final["state"]) == set(ours["final"])
    for key, value in final["state"].items():
        torch.testing.assert_close(value, torch.tensor(ours["final"][key]), rtol=0, atol=1e-6)


def test_converting_refuses_a_non_empty_target_and_unknown_formats(
        ours_to_fsdp2: Path, tmp_path: Path) -> None:
    from zero_strategy import cli

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    src = str(ours_to_fsdp2 / "ours" / "at3")
    assert cli.main(["convert", src, str(tmp_path / "taken"), "--to", "dcp"]) == 2
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    with pytest.raises(SystemExit):
        cli.main(["convert", src, str(tmp_path / "x"), "--to", "safetensors"])
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_converted_checkpoints_round_trip_exactly(written: Path, tmp_path: Path) -> None:
    """DCP -> ours -> DCP: every weight, moment, step and hyperparameter unchanged; and the
    converted checkpoint of ours verifies (its manifest lists every file's sha256)."""
    from zero_strategy.checkpoint.convert import convert

    src = written / "fsdp2" / "at3"
    convert(src, tmp_path / "zero", "zero")
    convert(tmp_path / "zero", tmp_path / "dcp", "dcp")
    first, last = open_reader(src), open_reader(tmp_path / "dcp")
    zero = open_reader(tmp_path / "zero")
    zero.verify_all()
    assert zero.manifest["converted_from"].startswith("torch.distributed.checkpoint")
    for name in first.manifest["params"]:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(first.read_param(name, key), last.read_param(name, key))
    assert first.manifest["param_states"] == last.manifest["param_states"]
    assert first.manifest["param_groups"] == last.manifest["param_groups"]
    assert first.param_groups_of() == last.param_groups_of()
    assert last.client_state() == first.client_state() == {"train_state": {"data_step": 3}}


def _compare(root: Path, name: str) -> dict:
    ours = json.loads((root / name / "ours.json").read_text())
    anchor_losses = json.loads((root / name / "losses.json").read_text())
    final = consolidate(root / name / "at6")
    assert ours["restored"]["lr"] == 1e-2 and ours["restored"]["weight_decay"] == 0.1
    assert ours["losses"] == pytest.approx(anchor_losses, rel=1e-6)
    assert set(ours["final"]) == set(final)
    for key, value in final.items():
        torch.testing.assert_close(torch.tensor(ours["final"][key]), value, rtol=0, atol=1e-6)
    return ours


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed not installed (the anchors extra)")
def test_deepspeed_zero3_on_2_ranks_resumes_at_our_stage2_on_3(written: Path) -> None:
    ours = _compare(written, "ds3")
    assert ours["restored"]["global_step"] == 3
    assert ours["client"] == {"data_step": 3}  # DeepSpeed's client_state comes back


def test_fsdp2_dcp_on_2_ranks_resumes_at_our_stage3_on_1(written: Path) -> None:
    ours = _compare(written, "fsdp2")
    assert ours["restored"]["global_step"] == 3  # Adam's step count, as DCP holds no other
    assert ours["client"] == {"train_state": {"data_step": 3}}


def test_loaded_optimizer_state_is_the_anchors(written: Path) -> None:
    """The moments read back equal what the anchor's own loader sees, element for element:
    DCP's via dcp.load into a plain state dict, DeepSpeed's via zero_to_fp32's layout."""
    import torch.distributed.checkpoint as dcp

    reader = open_reader(written / "fsdp2" / "at3")
    name = "blocks.0.0.weight"
    shape = tuple(reader.manifest["params"][name]["shape"])
    target = {"optimizer": {"state": {name: {"exp_avg": torch.zeros(shape)}}}}
    dcp.load(target, checkpoint_id=str(written / "fsdp2" / "at3"), no_dist=True)
    torch.testing.assert_close(reader.read_param(name, "exp_avg"),
                               target["optimizer"]["state"][name]["exp_avg"], rtol=0, atol=0)
    smallest = min(reader.read_param(n, "exp_avg_sq").sqrt().min().item()
                   for n in reader.manifest["params"])
    assert smallest > 1e-6  # no element where Adam's eps dominates (see the tolerance)


# ---------------------------------------------------------------- strangers' files
class _Payload:
    """Unpickling this runs a shell command: what a hostile checkpoint carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _refused(path: Path, marker: Path, client: bool = False) -> None:
    from zero_strategy.checkpoint.errors import CheckpointError

    with pytest.raises(CheckpointError, match="trust_pickles=True") as error:
        open_reader(path).client_state() if client else consolidate(path)
    assert "can run any code" in str(error.value)
    assert not marker.exists(), "the payload ran"


def test_hostile_dcp_metadata_is_refused(written: Path, tmp_path: Path) -> None:
    import pickle

    ckpt = _copy(written / "fsdp2" / "at3", tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker), protocol=4))
    _refused(ckpt, marker)


def test_hostile_dcp_item_and_lightning_meta_are_refused(written: Path, tmp_path: Path) -> None:
    """A bytes item pointed at a payload appended to a data file; and a payload as the
    ``meta.pt`` Lightning's FSDPStrategy writes beside the shards."""
    import io
    import pickle

    ckpt = _copy(written / "fsdp2" / "at3", tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    meta = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: trusted here
    blob = io.BytesIO()
    torch.save(_Payload(marker), blob)
    key = next(k for k in meta.storage_data if k.fqn == "train_state.data_step")
    info = meta.storage_data[key]
    data = ckpt / info.relative_path  # appended to the file the item is read from
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(blob.getvalue())
    meta.storage_data[key] = type(info)(info.relative_path, offset, len(blob.getvalue()),
                                        info.transform_descriptors)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    _refused(ckpt, marker, client=True)
    ckpt = _copy(written / "fsdp2" / "at3", tmp_path / "ckpt2")
    torch.save(_Payload(marker), ckpt / "meta.pt")
    _refused(ckpt, marker, client=True)


def test_opting_in_reads_what_the_allow_list_refuses(written: Path, tmp_path: Path) -> None:
    from argparse import Namespace

    from zero_strategy.checkpoint.errors import CheckpointError

    ckpt = _copy(written / "fsdp2" / "at3", tmp_path / "ckpt")
    torch.save({"hparams": Namespace(lr=1)}, ckpt / "meta.pt")  # harmless, but not allowed
    with pytest.raises(CheckpointError, match="Namespace"):
        open_reader(ckpt).client_state()
    assert open_reader(ckpt, trust=True).client_state()["hparams"] == Namespace(lr=1)


def test_truncated_dcp_data_is_a_clear_error(written: Path, tmp_path: Path) -> None:
    from zero_strategy.checkpoint.errors import CheckpointError

    ckpt = _copy(written / "fsdp2" / "at3", tmp_path / "ckpt")
    data = ckpt / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp.*outside the file's 100"):
        consolidate(ckpt)


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed not installed (the anchors extra)")
def test_hostile_and_incomplete_deepspeed_files(written: Path, tmp_path: Path) -> None:
    import shutil

    from zero_strategy.checkpoint.errors import CheckpointError

    ckpt = _copy(written / "ds3" / "at3", tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    optim = ckpt / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _Payload(marker)}, optim)
    _refused(ckpt, marker)
    optim.unlink()
    with pytest.raises(CheckpointError, match=r"'partition_count' is \[2\] but 1 optimizer"):
        consolidate(ckpt)
    shutil.copy(written / "ds3" / "at3" / "global_step3" / optim.name, optim)
    (ckpt / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"ranks \[1\]: some rank's file is missing"):
        consolidate(ckpt)


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed not installed (the anchors extra)")
def test_every_deepspeed_stage_and_precision_reads_as_deepspeed_sees_it(tmp_path: Path) -> None:
    """Stages 1, 2 and 3, fp32 and bf16 training, 2 ranks: every parameter's fp32 master and
    Adam moments read from the files equal, bit for bit, what DeepSpeed's own
    ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` gathered from the live
    optimizer before saving; the step count and hyperparameters come back too."""
    _torchrun("deepspeed-zoo", str(tmp_path), cwd=tmp_path)
    for stage in (1, 2, 3):
        for precision in ("fp32", "bf16"):
            path = tmp_path / f"s{stage}_{precision}"
            reference = torch.load(path / "reference.pt", weights_only=True)
            reader = open_reader(path)
            assert reader.manifest["written_by"].endswith(f"ZeRO stage {stage}")
            assert reader.manifest["param_groups"][0]["lr"] == 1e-2
            for name, states in reference.items():
                assert reader.manifest["param_states"][name]["scalars"] == {"step": 2.0}
                for key, value in states.items():
                    assert torch.equal(reader.read_param(name, key), value.float()), (
                        path.name, name, key)


def _adapter_load(kind: str, folder: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    script = ROOT / "tests" / "worlds" / "accelerate_foreign.py"
    run = subprocess.run([sys.executable, str(script), kind, str(folder)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_accelerate_load_state_reads_accelerates_fsdp_folder(written: Path) -> None:
    """``ZeroAccelerator.load_state`` on the folder Accelerate's FSDP ``save_state`` writes
    (``pytorch_model_fsdp_0/`` and ``optimizer_0/``, two DCP directories): every weight as
    the file has it, the file's lr (0.01, not the optimizer's 0.5) and step count."""
    folder = written / "fsdp2" / "accel3"
    assert sorted(p.name for p in folder.iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0"]
    reader, nested = open_reader(folder), open_reader(written / "fsdp2" / "at3")
    assert reader.manifest["param_states"] == nested.manifest["param_states"]
    out = _adapter_load("accelerate", folder)
    assert out["equal"] == out["keys"] and len(out["keys"]) == 12
    assert out["lr"] == 1e-2 and out["global_step"] == 3


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed not installed (the anchors extra)")
def test_fabric_load_reads_a_deepspeed_checkpoint(written: Path) -> None:
    """``fabric.load(path, {"model", "optimizer"})`` with ZeroFabricStrategy on DeepSpeed's
    files; DeepSpeed's client state is what comes back unrestored, as Fabric returns it."""
    out = _adapter_load("fabric", written / "ds3" / "at3")
    assert out["equal"] == out["keys"] and len(out["keys"]) == 12
    assert out["lr"] == 1e-2 and out["global_step"] == 3
    assert out["rest"] == {"data_step": 3}


def test_torchtitans_flattened_optimizer_reads_as_the_nested_one(written: Path) -> None:
    """``flatten_optimizer_state_dict=True`` (torchtitan's checkpoints): the same moments,
    steps, hyperparameters and groups as the nested form of the same step."""
    nested, flat = open_reader(written / "fsdp2" / "at3"), open_reader(written / "fsdp2" / "flat3")
    assert flat.manifest["param_states"] == nested.manifest["param_states"]
    assert flat.manifest["param_groups"] == nested.manifest["param_groups"]
    assert flat.param_groups_of() == nested.param_groups_of()
    for name in nested.manifest["params"]:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(flat.read_param(name, key), nested.read_param(name, key))


def test_lightning_resumes_only_what_lightning_wrote() -> None:
    """``Trainer.fit(ckpt_path=...)`` with ZeroStrategy: a DeepSpeed or DCP checkpoint that
    Lightning wrote carries its loops and schedulers and is handed to Lightning as they are;
    one written outside Lightning has none, and is refused before anything is loaded, naming
    what to do instead (the recipe switch test resumes Lightning-written ones end to end)."""
    from zero_strategy.integrations.shared import LIGHTNING_MARK, foreign_state

    written = {LIGHTNING_MARK: "2.6.6", "loops": {"fit_loop": {}}, "global_step": 4}
    state = foreign_state(written, Path("ckpt"), "ZeroStrategy", "deepspeed")
    assert state["lightning"] == written and state["param_groups"] is None
    with pytest.raises(ValueError, match=r"not written by Lightning.*engine.load_checkpoint"):
        foreign_state({"data_step": 3}, Path("ckpt"), "ZeroStrategy", "deepspeed")
    # Fabric and Accelerate take any client state: it is theirs to interpret
    assert foreign_state({"data_step": 3}, Path("ckpt"), "ZeroFabricStrategy",
                         "dcp")["state"] == {"data_step": 3}


def test_a_latest_link_out_of_the_directory_is_refused(written: Path, tmp_path: Path) -> None:
    """DeepSpeed's ``latest`` is read like ours: inside the directory, a plain tag name."""
    import shutil

    from zero_strategy.checkpoint.errors import CheckpointError

    ckpt = _copy(written / "fsdp2" / "at3", tmp_path / "ckpt")
    shutil.rmtree(ckpt)
    ckpt.mkdir()
    (tmp_path / "elsewhere").write_text("global_step3")
    (ckpt / "latest").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="latest"):
        open_reader(ckpt)
