"""The complete examples of the README and the docs site run as a user would run them: each
block marked ``<!-- test: python -->`` as a script in a fresh directory, ``<!-- test: torchrun
N -->`` under ``torch.distributed.run``, side by side (they are mostly interpreter start-up)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.doc_blocks import ROOT, RUNNABLE


def _command(how: str, script: Path) -> list[str]:
    if how == "python":
        return [sys.executable, str(script)]
    match = re.fullmatch(r"torchrun (\d+)", how)
    if match is None:
        raise ValueError(f"unknown docs test marker {how!r} (python | torchrun N)")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", match.group(1), str(script)]


def _run(how: str, code: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="zs-docs-") as tmp:
        script = Path(tmp, "example.py")
        script.write_text(code)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        return subprocess.run(_command(how, script), cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=420)


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=len(RUNNABLE) or 1) as pool:
        done = {where: pool.submit(_run, how, code) for where, how, code in RUNNABLE}
        return {where: future.result() for where, future in done.items()}


@pytest.mark.parametrize("where", [w for w, _, _ in RUNNABLE])
def test_complete_example_runs(runs: dict, where: str) -> None:
    result = runs[where]
    assert result.returncode == 0, f"{where}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def test_the_engine_example_trains(runs: dict) -> None:
    """The README's engine example prints its first and last loss: training lowered it."""
    where = next(w for w, how, _ in RUNNABLE if w.startswith("README.md") and "torchrun" in how)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", runs[where].stdout)]
    assert len(losses) == 2 and losses[1] < losses[0] / 2, runs[where].stdout
