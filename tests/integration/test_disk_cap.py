"""The disk tier holds a memory cap: the shared bench's memory-regime GPT-2 (168 M parameters,
about 2.7 GB of fp32 model states with AdamW) trains at N=1, stage 3, both tiers on "disk",
inside a 1 GiB memory cgroup, with the losses of the same run on "cpu" offload bit for bit.

Needs root and cgroup v1's memory controller (the test creates and removes the group);
skipped with the reason otherwise. About 80 s: two 2-step runs of a 168 M model; then 24
layers at 128 tokens, killed by the cap as they are and trained with activation
checkpointing (2 min).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
CGROUPS = Path("/sys/fs/cgroup/memory")
CAP = 1 << 30


def _bench(tier: str, out: Path, offload_dir: Path | None, cgroup: Path | None) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "disk_bench.py"), "--tier", tier,
           "--steps", "2", "--json", str(out)]
    if offload_dir is not None:
        cmd += ["--offload-dir", str(offload_dir)]
    if cgroup is not None:  # joins the group before Python starts, so every byte counts
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"{tier} run failed (returncode {done.returncode}; -9 is the cgroup's OOM kill):\n"
        f"{done.stderr[-4000:]}")


def _memory_cgroup() -> Path:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a memory cgroup")
    if not (CGROUPS / "memory.limit_in_bytes").exists():
        pytest.skip("needs cgroup v1's memory controller at /sys/fs/cgroup/memory")
    group = CGROUPS / f"zero_strategy_cap_{uuid.uuid4().hex[:8]}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(CAP))
    return group


def test_disk_tier_trains_168m_in_one_gib(tmp_path: Path) -> None:
    group = _memory_cgroup()
    try:
        _bench("disk", tmp_path / "disk.json", tmp_path / "offload", group)
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        oom = (group / "memory.oom_control").read_text()
    finally:
        group.rmdir()
    _bench("cpu", tmp_path / "cpu.json", None, None)
    disk = json.loads((tmp_path / "disk.json").read_text())
    cpu = json.loads((tmp_path / "cpu.json").read_text())
    assert disk["params"] == cpu["params"] > 160_000_000
    # Same arithmetic, only where the bytes rest differs: equal to the last bit.
    assert disk["losses"] == cpu["losses"]
    kills = dict(line.split() for line in oom.splitlines()).get("oom_kill", "0")
    assert peak <= CAP and kills == "0"
    # All 2.7 GB of model states rested in files; what training added to the process's
    # anonymous memory (where the tier's reads land; sampled every 20 ms) stayed
    # within the window estimate_memory predicts from the two largest units (656 MiB here
    # with what the tier keeps between phases; measured 552-616 MiB) plus what is not a
    # model state: activations (47 MiB at 32 tokens: zs.estimate_activations) and
    # autograd's temporaries, bounded by 128 MiB.
    report = disk["memory_report"]
    assert report["disk_bytes"] >= 16 * 160_000_000
    added = disk["peak_resident"] - disk["baseline_resident"]
    predicted = report["predicted_resident_bytes"]
    assert 0 < added <= predicted + (128 << 20)
    assert predicted + disk["baseline_resident"] < CAP
    assert not (tmp_path / "offload" / "rank0").exists(), "close() removes the tier's files"


def test_checkpointing_trains_what_activations_kill_in_one_gib(tmp_path: Path) -> None:
    """24 layers of the same GPT (319 M parameters) at 128 tokens in the same 1 GiB: as it
    is, 24 layers' activations (about 0.5 GiB) push the process over the cap in its first
    step (the kernel's OOM kill); with ``activation_checkpointing=True,
    offload_activations="disk"`` it trains, keeping 21 MiB of activations, what the formula
    predicts. About 2 minutes (tests/integration is the slow tier)."""
    _memory_cgroup().rmdir()  # skips without root or cgroup v1, before any work
    from bench.activation_cap import run_capped

    args = SimpleNamespace(cap_gib=1.0, steps=2, seq=128, offload_dir=str(tmp_path / "ssd"))
    plain = run_capped(24, False, args)
    assert not plain["trained"] and plain["oom_kills"] > 0, plain
    checkpointed = run_capped(24, True, args)
    assert checkpointed["trained"] and checkpointed["oom_kills"] == 0, checkpointed
    assert checkpointed["params"] > 300_000_000
    assert all(math.isfinite(x) for x in checkpointed["losses"])
    predicted = checkpointed["predicted_activations"]
    # The engine's count of what the first forward kept, on the device and on disk, against
    # the formula's (docs/activations.md; the issue asks for 20 %): both count the same
    # storages, but a tensor a layer keeps that the embedding keeps too (the position ids)
    # is on the device and, copied, on disk: counted twice here, once there.
    kept = checkpointed["activation_bytes"] + checkpointed["offloaded_activation_bytes"]
    assert abs(kept - predicted["saved_bytes"]) <= 0.01 * predicted["saved_bytes"]
    # Anonymous memory grew by no more than the model-state window estimate_memory predicts
    # plus backward's activation peak (one layer recomputed) and 64 MiB for autograd's and
    # the allocator's temporaries, which neither formula counts.
    assert checkpointed["added_resident"] <= (checkpointed["predicted_window"]
                                              + predicted["peak_bytes"] + (64 << 20))
    assert not [p for p in (tmp_path / "ssd").iterdir() if p.is_dir()], "files left behind"
