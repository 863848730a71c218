"""The ZeRO formula on every path (issue 58): each phase of a stage-3 job at N=2 (load,
forward, backward, step, save) grows each rank's memory by no more than the bound
``engine.phase_bounds()`` states (``zero_strategy/memory/phases.py``), on every entry point
(the engine, Fabric, Lightning, ``ZeroAccelerator``, ``ZeroTrainer``,
``with_zero(SFTTrainer)``, and TRL's frozen reference beside a DPO policy) and for every
freezing pattern (full, head only, the last blocks, the first block only, LoRA on every
block and on some).

One torchrun launch per entry point runs its patterns in turn (``bench/phase_memory.py``,
which says how each is measured); the model is a 241 MiB GPT-2, and every bound stays within
the model's size of what was measured, so a whole copy of the model held anywhere shows as a
phase over its bound. About 5 minutes on 2 cores for the 7 launches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.worlds.accelerate_launch import launch_environment

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # bench scripts import their siblings by name

import phase_memory as P  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    path = tmp_path_factory.mktemp("phase_memory") / "gpt2"
    params = P.make_folder(path)
    return path, params * 4 / P.MIB


def _launch(path: str, folder: Path, out: Path) -> dict[int, dict[str, Any]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(ROOT / "bench" / "phase_memory.py"),
               "--path", path, "--folder", str(folder), "--out", str(out)]
    # glibc returns freed buffers of 64 KiB and more at once, so a phase's growth is its own
    done = subprocess.run(command, env=launch_environment({"MALLOC_MMAP_THRESHOLD_": "65536"}),
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    ranks = {}
    for rank in (0, 1):
        file = out / f"rank{rank}.json"
        assert file.exists(), f"{path}: no result from rank {rank} (exit {done.returncode}):\n" \
                              f"{done.stderr[-4000:]}"
        ranks[rank] = json.loads(file.read_text())
    return ranks


@pytest.mark.parametrize("path", P.PATHS)
def test_every_phase_grows_within_its_bound(path: str, folder: tuple[Path, float],
                                            tmp_path: Path) -> None:
    model_folder, model_mib = folder
    ranks = _launch(path, model_folder, tmp_path)
    expected = ["reference"] if path == "reference" else list(P.PATTERNS)
    failures = []
    for rank, patterns in ranks.items():
        assert sorted(patterns) == sorted(expected), f"{path} rank {rank}: {sorted(patterns)}"
        for pattern, r in patterns.items():
            assert "error" not in r, f"{path} / {pattern} rank {rank} raised:\n{r['error']}"
            print(f"{path:12} {pattern:12} rank {rank}: "
                  + ", ".join(f"{ph} {r['growth'][ph]:.0f}/{r['bound'][ph]:.0f}"
                              for ph in P.PHASES) + " MiB (growth/bound)")
            for phase in P.PHASES:
                growth, bound = r["growth"][phase], r["bound"][phase]
                where = (f"phase {phase}, path {path}, pattern {pattern}, rank {rank}: grew "
                         f"{growth} MiB, bound {bound} MiB (terms {r['terms']})")
                if growth > bound:
                    failures.append(f"over the bound: {where}")
                # The bound can tell: one more copy of the model would exceed it.
                if bound - growth >= model_mib:
                    failures.append(f"bound too loose to see a whole model ({model_mib:.0f} "
                                    f"MiB): {where}")
    assert not failures, "\n".join(failures)
