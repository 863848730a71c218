"""GPU checks (nccl, pinned memory, host<->device copies). Skipped without CUDA; every path
they touch also has a CPU test."""

from __future__ import annotations

import pytest
import torch

from tests.harness import check, run_world

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def world() -> dict:
    n = min(2, torch.cuda.device_count())
    return run_world("tests/scenarios_cuda.py", n, env={"ZS_BACKEND": "nccl"})


@pytest.mark.parametrize("name", ["gpu_stage1", "gpu_stage2", "gpu_stage3"])
def test_nccl_stages_train(world: dict, name: str) -> None:
    for r in check(world[name]):
        assert r["master_devices"] == ["cuda"]
        assert all(x == x for x in r["losses"]) and r["losses"][-1] < r["losses"][0]
        assert r["report"]["ratio_to_formula"] == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("name", ["gpu_stage3_offload_bf16", "gpu_stage2_offload"])
def test_offload_uses_pinned_host_memory(world: dict, name: str) -> None:
    for r in check(world[name]):
        assert r["master_devices"] == ["cpu"] and r["pinned"]
        assert all(x == x for x in r["losses"]) and r["losses"][-1] < r["losses"][0]
