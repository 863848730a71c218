"""What Ray Train needs of us, at its smallest (the jobs themselves run in
tests/integration/test_ray.py): which worker uploads which file of a checkpoint folder, and
the Lightning and Fabric strategies' device and sampler under a launcher that gives each
worker one device and numbers local ranks across a node's workers (Ray's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_strategy.checkpoint.write import MANIFEST, shard_file, shard_of
from zero_strategy.integrations.shared import process_device, sampler_kwargs

# ------------------------------------------------------------------------------ install
WITHOUT_RAY = """
import importlib.abc, importlib.util, sys
_find = importlib.util.find_spec
class Absent(importlib.abc.MetaPathFinder):  # as after `pip install zero-strategy[...]`
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ray":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] == "ray" else _find(name, package))
import zero_strategy, zero_strategy.lightning, zero_strategy.fabric, zero_strategy.accelerate
import zero_strategy.transformers, recipes.launch
try:
    import zero_strategy.ray
except ImportError as e:
    print(e)
"""


def test_every_other_entry_point_imports_without_ray() -> None:
    """Ray hidden (as if not installed): the engine, the Lightning, Fabric, Accelerate and
    transformers entry points and the recipes' launcher import, and ``zero_strategy.ray``
    raises ImportError naming the extra. (That no other module imports Ray at all is
    test_import_graph's static check.)"""
    result = subprocess.run([sys.executable, "-c", WITHOUT_RAY], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'pip install "zero-strategy[ray]"' in result.stdout, result.stdout


# ------------------------------------------------------------------------------ ownership
def _folder(root: Path) -> set[str]:
    """A Trainer's checkpoint-N/ as we write it: our tag with 3 shards, a shard-named file
    outside any tag (not ours: rank 0's), the framework's files."""
    names = {"zero_checkpoint/latest", f"zero_checkpoint/checkpoint/{MANIFEST}",
             "zero_checkpoint/checkpoint/module.safetensors", "trainer_state.json",
             "rng_state_1.pth", "extra/shard-00002.safetensors",
             *(f"zero_checkpoint/checkpoint/{shard_file(k)}" for k in range(3))}
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(name.encode())
    return names


def test_every_file_is_uploaded_by_exactly_one_worker(tmp_path: Path) -> None:
    report = pytest.importorskip("zero_strategy.integrations.ray.report",
                                 reason="needs Ray (the ray extra)")
    names = _folder(tmp_path)
    owned = [{str(p) for p in report.owned_files(tmp_path, rank)} for rank in range(4)]
    assert owned[1] == {f"zero_checkpoint/checkpoint/{shard_file(1)}"}
    assert owned[2] == {f"zero_checkpoint/checkpoint/{shard_file(2)}"}
    assert owned[3] == set()  # a world larger than the one that saved uploads nothing more
    assert owned[0] == names - owned[1] - owned[2]
    assert "extra/shard-00002.safetensors" in owned[0]


def test_a_link_or_a_missing_folder_is_refused_naming_it(tmp_path: Path) -> None:
    report = pytest.importorskip("zero_strategy.integrations.ray.report",
                                 reason="needs Ray (the ray extra)")
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        report.owned_files(tmp_path / "absent", 0)
    _folder(tmp_path)
    os.symlink("/etc/hostname", tmp_path / "outside")
    with pytest.raises(ValueError, match="outside.*symbolic link"):
        report.owned_files(tmp_path, 0)


def test_shard_names_parse_back_to_their_index() -> None:
    assert [shard_of(shard_file(k)) for k in (0, 7, 12345)] == [0, 7, 12345]
    assert shard_of("shard-1.safetensors") is None and shard_of("module.safetensors") is None


# ------------------------------------------------------------------------------ devices
def test_the_device_of_a_worker_given_one() -> None:
    cpu = torch.device("cpu")
    assert process_device([cpu, cpu], 1) == cpu  # torchrun: one device per local rank
    assert process_device([cpu], 1) == cpu  # Ray: the worker's own device, local rank 1
    assert sampler_kwargs(4, 3) == {"num_replicas": 4, "rank": 3}


class _RayLikeEnvironment:
    """What RayLightningEnvironment reports to the second worker of a node (a duck type:
    Ray is not needed to check the strategies)."""

    creates_processes_externally = True
    main_address, main_port = "127.0.0.1", 29500

    def world_size(self) -> int:
        return 2

    def global_rank(self) -> int:
        return 1

    def local_rank(self) -> int:
        return 1

    def node_rank(self) -> int:
        return 0

    def set_world_size(self, size: int) -> None:
        pass  # Ray's world: the size Ray gave, whatever Lightning computes

    def set_global_rank(self, rank: int) -> None:
        pass

    def teardown(self) -> None:
        pass


@pytest.mark.parametrize("adapter", ["lightning", "fabric"])
def test_strategies_take_the_device_and_replicas_from_the_world(adapter: str) -> None:
    """Lightning's DDP indexes its device list by the local rank (``IndexError`` for Ray's
    second worker, whose list holds its one device) and counts replicas as nodes x devices
    (1: every worker would read all the data)."""
    pytest.importorskip("lightning")
    if adapter == "lightning":
        from zero_strategy.lightning import ZeroStrategy as Strategy
    else:
        from zero_strategy.fabric import ZeroFabricStrategy as Strategy
    strategy = Strategy(stage=3, parallel_devices=[torch.device("cpu")],
                        cluster_environment=_RayLikeEnvironment())
    assert strategy.root_device == torch.device("cpu")
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
