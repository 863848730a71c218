"""Stopping a recipe job stops all of it: Ctrl-C (SIGINT to the terminal's process group) and
SIGTERM to the launcher end the agent and every worker within seconds, a SIGKILLed launcher
leaves no worker behind, and a multirun stopped in its first job starts no other.

Each launch is a real ``python recipes/train.py`` in a session of its own (a terminal's
foreground group stand-in), training without end; its processes are found by a marker in
their environment, which the agent and the workers inherit whatever session they are in.
The launches run side by side: most of their time is start-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENDLESS = ("model.size=tiny", "trainer=fast", "trainer.max_steps=1000000",
           "trainer.checkpoint_every=0", "trainer.val_check_interval=1000000")
STOP_WITHIN_S = 10.0
"""Measured 0.2-4 s (the workers end at once on SIGTERM); lifetime.GRACE_S (15 s) would bound
a stuck orderly stop, torch.distributed.run's 30 s one after a SIGKILLed launcher."""


def marked(marker: str) -> list[int]:
    """Every live process whose environment carries ``marker``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if marker.encode() in environ and not zombie:
            pids.append(int(entry))
    return pids


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def catch_sigterm(marker: str, launcher: int) -> list[int]:
    """The job's workers (the agent's children: neither the launcher nor its child) that run
    a handler on SIGTERM instead of its default action (bit 15 of SigCgt, /proc/<pid>/status).
    Forked workers keep the agent's /proc environ, so the tree tells them apart."""
    catching = []
    for pid in marked(marker):
        try:
            if launcher in (pid, parent(pid)):
                continue
            with open(f"/proc/{pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f
                              if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            continue
        if caught & (1 << (signal.SIGTERM - 1)):
            catching.append(pid)
    return catching


def stop_job(how: str, tmp: Path, *args: str) -> dict:
    marker = uuid.uuid4().hex
    env = {**os.environ, "ZS_LIFETIME_TEST": marker, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), *args, *ENDLESS,
           f"hydra.run.dir={tmp}/run", f"hydra.sweep.dir={tmp}/sweep"]
    launcher = subprocess.Popen(cmd, env=env, cwd=tmp, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = time.monotonic()
    while len(marked(marker)) < 4:  # the launcher, the agent, two workers
        if launcher.poll() is not None or time.monotonic() - started > 240:
            launcher.kill()
            return {"error": "the job never started: " + launcher.communicate()[0][-3000:]}
        time.sleep(0.5)
    time.sleep(3)  # into training
    # Lightning's SIGTERM handler, which runs a collective, gives way to the default action
    # (lifetime.end_at_once_on_sigterm) once training starts; with it, stops took 18-30 s.
    waited = time.monotonic()
    while catch_sigterm(marker, launcher.pid) and time.monotonic() - waited < 60:
        time.sleep(0.5)
    catching = catch_sigterm(marker, launcher.pid)
    before = len(marked(marker))
    sent = time.monotonic()
    if how == "ctrl-c":
        os.killpg(launcher.pid, signal.SIGINT)
    else:
        os.kill(launcher.pid, signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    while marked(marker) and time.monotonic() - sent < 90:
        time.sleep(0.2)
    left = marked(marker)
    for pid in left:  # never leave them to the rest of the suite
        os.kill(pid, signal.SIGKILL)
    output = launcher.communicate(timeout=30)[0]
    return {"before": before, "left": left, "catching": catching,
            "seconds": time.monotonic() - sent, "code": launcher.returncode, "output": output,
            "jobs": sorted(p.name for p in (tmp / "sweep").glob("*") if p.is_dir())}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    launches = {
        "ctrl-c": ("ctrl-c",),
        "sigterm": ("sigterm",),
        "sigkill": ("sigkill",),
        "multirun": ("ctrl-c", "-m", "strategy=zero2,zero3"),
        "subprocess": ("sigterm", "trainer.preload=false"),
    }
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = {name: pool.submit(stop_job, how[0], tmp_path_factory.mktemp(name), *how[1:])
                   for name, how in launches.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", ["ctrl-c", "sigterm", "sigkill", "multirun", "subprocess"])
def test_stopping_the_launcher_stops_every_process_of_the_job(stopped: dict,
                                                                 name: str) -> None:
    r = stopped[name]
    assert "error" not in r, r["error"]
    assert r["before"] >= 4
    assert not r["catching"], f"workers still handling SIGTERM in training: {r['catching']}"
    assert not r["left"], f"still running {r['seconds']:.1f} s after the signal: {r['left']}"
    assert r["seconds"] < STOP_WITHIN_S, r["seconds"]
    expected = {"ctrl-c": -signal.SIGINT, "multirun": -signal.SIGINT,
                "sigkill": -signal.SIGKILL}.get(name, -signal.SIGTERM)
    assert r["code"] == expected, r["output"][-3000:]
    if name != "sigkill":
        assert "the job's agent and workers have ended" in r["output"], r["output"][-3000:]


def test_a_multirun_stopped_in_its_first_job_starts_no_other(stopped: dict) -> None:
    r = stopped["multirun"]
    assert len(r["jobs"]) == 1 and "strategy=zero2" in r["jobs"][0], r["jobs"]
    assert r["output"].count("processes: ") == 1, r["output"][-3000:]
