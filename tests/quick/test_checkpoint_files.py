"""Checkpoint files outside the engine: atomicity under a killed rank, streaming consolidation,
and the zero-strategy command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zero_strategy as zs
from tests.support.harness import ROOT, _free_port, check, run_world
from tests.support.models import make_model
from zero_strategy import cli


def _launch(script: str, nproc: int, *args: str) -> list[subprocess.Popen]:
    port = str(_free_port())
    env_base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                "WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return [subprocess.Popen([sys.executable, str(ROOT / script), *args],
                             env={**env_base, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(nproc)]


def test_rank_killed_mid_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    procs = _launch("tests/worlds/ckpt_crash.py", 2, str(tmp_path))
    deadline = time.time() + 120
    while procs[1].poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert procs[1].returncode == 17, procs[1].communicate()[0][-3000:]
    procs[0].kill()  # what a launcher does to the survivors of a failed job
    procs[0].wait()
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists() and (tmp_path / ".tmp-bad").exists()
    state = zs.consolidate(tmp_path)  # loads 'latest', and verifies every file
    model = make_model("mlp")
    model.load_state_dict(state, strict=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("consolidate")
    check(run_world("tests/worlds/scenarios_checkpoint.py", 1, env={"ZS_CKPT_ROOT": str(root),
                                                            "ZS_BIG": "1"})["big"])
    return root


def test_cli_consolidate_gives_a_strict_state_dict(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    run = subprocess.run([sys.executable, "-m", "zero_strategy.cli", "consolidate",
                          str(saved / "gpt2"), str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    state = load_file(str(out))
    model = make_model("gpt2")
    model.load_state_dict(state, strict=True)  # both tied keys are present
    reference = zs.consolidate(saved / "gpt2")
    assert set(state) == set(reference) and all(torch.equal(state[k], reference[k])
                                                 for k in state)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    bf16 = tmp_path / "bf16.safetensors"
    assert cli.main(["consolidate", str(saved / "gpt2"), str(bf16), "--dtype", "bf16"]) == 0
    assert load_file(str(bf16))["lm_head.weight"].dtype == torch.bfloat16


def test_consolidation_streams(saved: Path, tmp_path: Path) -> None:
    """Peak RSS while consolidating a 67 MB model stays near one tensor (4 MB), far below
    the model size."""
    code = (
        "import resource, sys, zero_strategy as zs\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "zs.write_consolidated(sys.argv[1], sys.argv[2])\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)\n"
    )
    out = tmp_path / "big.safetensors"
    run = subprocess.run([sys.executable, "-c", code, str(saved / "big"), str(out)],
                         capture_output=True, text=True, check=True)
    peak_mib = int(run.stdout.split()[-1]) / 1024
    manifest = json.loads(next((saved / "big").glob("*/manifest.json")).read_text())
    model_mib = sum(torch.Size(p["shape"]).numel() * 4
                    for p in manifest["params"].values()) / 2**20
    assert model_mib > 60 and out.stat().st_size > 60 * 2**20
    assert peak_mib < 24, f"consolidation grew RSS by {peak_mib:.1f} MiB"


def test_cli_estimate_prints_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["estimate", "--params", "124M", "--stage", "3", "--world-size", "4",
                     "--precision", "bf16-mixed", "--reduce-dtype", "compute"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["zero0", "zero1", "zero2", "zero3"]
    assert "zero3 *" in out and lines[-1].endswith("473.0 MiB")  # 124M x 16 B / 4 / 2**20
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["estimate", "--params", "lots", "--world-size", "2"])
    assert exit_info.value.code == 2 and "not a parameter count" in capsys.readouterr().err
    assert cli.main(["estimate", "--params", "1M", "--world-size", "2", "--offload", "all"]) == 0
    assert "host" in capsys.readouterr().out


def test_cli_consolidate_reports_bad_checkpoint(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["consolidate", str(tmp_path), str(tmp_path / "x.safetensors")]) == 2
    assert "not a zero_strategy checkpoint" in capsys.readouterr().err
