"""Start a Lightning/Fabric scenario script the way a user would (one process; Lightning
starts rank 1 itself) and collect what each rank wrote.

Pytest must not be the process Lightning re-runs, so every distributed check lives in a
script under tests/ launched here.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The presets of tests/worlds/lightning_run.py's suites: the quick tier trains the stage-3
# ones (and every scenario that is not about one preset), the integration tier the others
# against the same DDP run.
QUICK_PRESETS = ("zero3", "zero3_units")
OTHER_PRESETS = ("zero1", "zero2", "zero2_offload", "zero3_offload", "zero2_disk", "zero3_disk")
# Set by a launcher: inherited, they would make Lightning believe its processes already exist.
_LAUNCH_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")


def script_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return env


def run_script(args: list[str], timeout: float = 400.0,
               env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``python *args`` in a new session so a hang can be killed with its children."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env={**script_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0] + f"\n[killed after {timeout} s]"
    return proc.returncode, log


def run_suite(script: str, suite: str, world_size: int = 2,
              timeout: float = 400.0) -> dict[str, list[Any]]:
    """{scenario: [rank 0's result, rank 1's, ...]} from ``python script suite OUT_DIR``."""
    out = tempfile.mkdtemp(prefix=f"zs-{suite}-")
    # Large blocks straight from mmap and back on free: RSS then follows live memory, so the
    # peak-RSS checks measure tensors rather than what malloc keeps cached.
    code, log = run_script([str(ROOT / script), suite, out], timeout,
                           env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    results: dict[str, list[Any]] = {}
    for rank in range(world_size):
        path = Path(out, f"rank{rank}.json")
        if not path.exists():
            raise RuntimeError(f"rank {rank} of {script} {suite} wrote no results "
                               f"(exit code {code}); log:\n{log[-8000:]}")
        for name, value in json.loads(path.read_text()).items():
            results.setdefault(name, []).append(value)
    results["_log"] = [log]
    return results


@functools.cache
def suite_results(suite: str = "quick") -> dict[str, list[Any]]:
    """A suite of tests/worlds/lightning_run.py, run once per pytest session: "quick" (both
    tests/quick/test_lightning.py and tests/quick/test_fabric.py assert on it) or "presets"
    (tests/integration/test_lightning_presets.py)."""
    return run_suite("tests/worlds/lightning_run.py", suite, timeout=500)


def hydra_run(args: list[str]) -> tuple[list[dict[str, Any]], str]:
    """tests/worlds/lightning_hydra_app.py with ``args`` (``OUT`` is replaced by a new
    directory): each process's record and the log."""
    out = Path(tempfile.mkdtemp(prefix="zs-hydra-"))
    app = str(ROOT / "tests" / "worlds" / "lightning_hydra_app.py")
    code, log = run_script([app, *[a.replace("OUT", str(out)) for a in args]], timeout=400)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert code == 0, f"hydra app failed ({code}):\n{log[-6000:]}"
    return records, log


def check(result: list[Any]) -> list[Any]:
    """The per-rank results of a scenario, failing with the script's traceback if any."""
    for rank, value in enumerate(result):
        if isinstance(value, dict) and "error" in value:
            raise AssertionError(f"rank {rank} failed:\n{value['error']}")
    return result
