"""GPU checks: parity with the global-batch reference at every stage on CUDA, delayed offload
copies, host syncs per step, peak memory against the formula, a GPU checkpoint loaded by a
CPU world, int8 collectives and hybrid sharding, ``device="cuda"`` without an index, the
pinned arena, the blocking gather-order check, a lost peer's timeout, Lightning and Fabric.
Skipped without CUDA (``python -m pytest -m cuda tests/quick/test_cuda.py`` runs them); every path
they touch also has a CPU test. See tests/worlds/scenarios_cuda.py for the tolerances."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import check, run_world

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Two ranks share one GPU through gloo's CUDA support: nccl refuses two ranks on one device.
SHARED_GPU = "cpu:gloo,cuda:gloo"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    ckpt = str(tmp_path_factory.mktemp("gpu-ckpt"))
    out = {1: run_world("tests/worlds/scenarios_cuda.py", 1,
                        env={"ZS_BACKEND": "nccl", "ZS_CKPT_ROOT": ckpt})}
    out[2] = run_world("tests/worlds/scenarios_cuda.py", 2, env={"ZS_BACKEND": SHARED_GPU,
                                                          "ZS_CKPT_ROOT": ckpt + "-2"})
    out[0] = run_world("tests/worlds/scenarios_cuda.py", 2,  # CPU gloo world reading the GPU's
                       env={"ZS_LOAD_GPU_CHECKPOINT": "1", "ZS_CKPT_ROOT": ckpt})
    return out


PARITY = ["parity_stage0", "parity_stage1", "parity_stage2", "parity_stage3",
          "parity_stage2_offload", "parity_stage3_offload", "parity_stage2_bf16",
          "parity_stage3_bf16_offload", "parity_stage1_fp16", "parity_stage3_fp16",
          "parity_stage2_accumulate", "parity_stage3_accumulate_offload",
          "parity_stage3_ckpt_cpu", "parity_stage2_ckpt_disk"]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", PARITY)
def test_matches_the_global_batch_reference(worlds: dict, n: int, name: str) -> None:
    for r in check(worlds[n][name]):
        assert r["rel_to_update"] <= r["tolerance"], r
        assert r["master_devices"] == (["cpu"] if "offload" in name else ["cuda"])
        # a GPU's activations leave it: each of the MLP's 3 blocks' inputs (4 x 33 fp32)
        assert r["offloaded"] == (3 * 4 * 33 * 4 if "ckpt" in name else 0)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", ["muon_stage1", "muon_stage3_offload"])
def test_muon_on_owners_matches_the_global_batch(worlds: dict, n: int, name: str) -> None:
    # fp32 summation order alone gives ~1e-6 on a GPU (see scenarios_cuda.py); Muon's bf16
    # Newton-Schulz may amplify it, bounded by 4x the distance DDP's rounding lands at.
    for r in check(worlds[n][name]):
        assert r["rel"] <= max(1e-4, 4 * r["noise"]), r


@pytest.mark.parametrize("n", [1, 2])
def test_delayed_offload_copies_change_nothing(worlds: dict, n: int) -> None:
    for r in check(worlds[n]["offload_race"]):
        assert r["losses_equal"] and r["weights_equal"]


@pytest.mark.parametrize("config", ["stage3", "stage2_offload", "stage2_bf16"])
def test_no_host_sync_per_unit(worlds: dict, config: str) -> None:
    """Three times the units, the same syncs per step: none is per unit."""
    small, large = (check(worlds[2][f"syncs_{config}_{n}"])[0] for n in (2, 6))
    assert large["per_step"] == small["per_step"], (small, large)
    assert large["per_step"] <= 4, large["first"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_peak_memory_follows_the_formula(worlds: dict, stage: int) -> None:
    """Model states dominate (activations of a batch of 2 are ~0.1 %): the peak may exceed
    the formula by transient buffers (a unit's full gradient before its reduce-scatter, a
    gathered unit, AdamW's temporaries), bounded here by half the formula."""
    for r in check(worlds[2][f"memory_stage{stage}"]):
        assert 0.95 <= r["ratio"] <= 1.5, r


def test_gpu_checkpoint_loads_in_a_cpu_world(worlds: dict) -> None:
    check(worlds[1]["save_on_gpu"])
    for r in check(worlds[0]["load_on_cpu"]):
        assert r["weights_equal"] and r["global_step"] == 3 and r["finite"]



@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", ["int8_stage3", "hybrid_groups_of_1_stage3"])
def test_int8_and_hybrid_sharding_match_the_global_batch(worlds: dict, n: int,
                                                         name: str) -> None:
    for r in check(worlds[n][name]):
        assert r["rel_to_update"] <= r["tolerance"], r


@pytest.mark.parametrize("n", [1, 2])
def test_cuda_without_an_index_is_the_current_device(worlds: dict, n: int) -> None:
    for r in check(worlds[n]["unindexed_device"]):
        assert r["device"] == r["expected"] and r["equal"], r


@pytest.mark.parametrize("n", [1, 2])
def test_offloaded_buffers_are_pinned_in_one_arena(worlds: dict, n: int) -> None:
    for r in check(worlds[n]["pinned_arena"]):
        assert r["pinned"] and r["reported"] == r["arena"] > 0 and r["allocations"] == 1, r


def test_a_blocking_gather_order_check_raises_before_any_wrong_exchange(worlds: dict) -> None:
    for r in check(worlds[2]["blocking_gather_order"]):
        assert r["raised"] and "ranks are gathering different units" in r["raised"], r
        assert r["unchanged"], r


def test_a_lost_peer_raises_the_named_timeout_on_the_gpu(worlds: dict) -> None:
    r = check(worlds[2]["timeout_on_the_gpu"])[0]
    assert r["raised"] and "did not complete within 2 s" in r["raised"], r
    assert r["seconds"] < 30, r


def test_lightning_and_fabric_zero3_match_ddp_on_the_gpu(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    from tests.support.harness import ROOT

    out = tmp_path / "adapters.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.worlds.cuda_adapters", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for name, r in json.loads(out.read_text()).items():
        assert r["device"] == "cuda:0" and r["rel"] <= 1e-4, (name, r)
