"""Run ``recipes/accelerate_train.py`` (or a test script) under a real ``accelerate launch``,
several at a time.

Each launch costs seconds of imports, so the tests start them all up front, a few in parallel,
and read back what each rank wrote (``rank<N>.json``) plus the launch's combined output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "accelerate_train.py"
CONF = ROOT / "conf" / "accelerate"
ACCELERATE_CONFIG = CONF / "multi_process.yaml"


@dataclass
class Job:
    """One training run: through ``accelerate launch`` (2 processes) or plain ``python``."""

    name: str
    args: list[str]
    out: Path
    env: dict[str, str] = field(default_factory=dict)
    launch: bool = True
    after: str | None = None
    """Name of a job that must finish first (a resume needs the saved state)."""
    launch_args: list[str] = field(default_factory=list)
    """Options for ``accelerate launch`` itself (e.g. ``--max_restarts``)."""
    script: Path = RECIPE
    """What runs: the recipe, or a test script taking ``--out DIR`` the same way."""


@dataclass
class Outcome:
    returncode: int
    log: str
    ranks: list[dict[str, Any]]


def launch_environment(extra: dict[str, str]) -> dict[str, str]:
    """The caller's environment without anything that would steer Accelerate or the plugin."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ACCELERATE_") and k != "ZERO_STRATEGY_CONFIG"}
    env.update({
        "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",  # the comparison is defined on CPU (gloo) everywhere
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    })
    env.update(extra)
    return env


def _command(job: Job) -> list[str]:
    script = [str(job.script), *job.args, "--out", str(job.out)]
    if not job.launch:
        return [sys.executable, *script]
    # `accelerate launch` with this interpreter: the launch command's own entry point, which
    # skips importing the CLI's other commands (about 2 s of CPU per launch).
    return [sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(ACCELERATE_CONFIG), *job.launch_args, *script]


def run_jobs(jobs: list[Job], parallel: int = 3, timeout: float = 400.0) -> dict[str, Outcome]:
    """Run ``jobs`` with at most ``parallel`` at once, each once its ``after`` has finished;
    {name: outcome}."""
    pending, running, done = list(jobs), [], {}
    deadline = time.monotonic() + timeout
    while pending or running:
        while len(running) < parallel:
            ready = [j for j in pending if j.after is None or j.after in done]
            if not ready:
                break
            job = ready[0]
            pending.remove(job)
            job.out.mkdir(parents=True, exist_ok=True)
            log = open(job.out / "log.txt", "w")  # a file, not a pipe: no deadlock on big logs
            proc = subprocess.Popen(_command(job), cwd=ROOT, env=launch_environment(job.env),
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its own group: kill all on timeout
            running.append((job, proc, log))
        for item in list(running):
            job, proc, log = item
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:  # past the deadline: the launcher and its workers
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            running.remove(item)
            done[job.name] = _collect(job, proc.returncode)
        time.sleep(0.1)
    return done


def _collect(job: Job, returncode: int) -> Outcome:
    files = sorted(job.out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    ranks = [json.loads(p.read_text()) for p in files]
    return Outcome(returncode, (job.out / "log.txt").read_text(), ranks)
