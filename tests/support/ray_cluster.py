"""One local Ray for a test module: started small (2 CPUs, a 150 MB object store), its temp
dir short (Ray's sockets live there, and an AF_UNIX path is limited to 107 bytes), its
workers given this checkout on PYTHONPATH; Ray Train jobs run on it and their checkpoints
read back; stopped at the end with nothing of it left running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.nodes import ROOT

OBJECT_STORE_BYTES = 150 * 2**20
WORKER_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore",
              "RAY_DEDUP_LOGS": "0"}
RAY_ENV = {"RAY_memory_monitor_refresh_ms": "0"}
"""Read by the raylet at start. Ray's memory monitor kills workers when the node's memory as a
whole passes 95 %, whoever uses it: on a machine shared with other jobs it killed this
module's workers (their own use was 0.1-0.4 GB each). Off, a real shortage is the kernel's."""


@dataclass
class Cluster:
    temp_dir: Path
    address: str
    """The GCS address another driver (a docs example, a Hydra job) connects to."""
    storage: Path
    """Where the jobs' checkpoints go (RunConfig.storage_path)."""
    env_before: dict[str, str | None]


def start(storage: Path) -> Cluster:
    """``ray.init`` of a new local instance; raises whatever keeps Ray from starting."""
    import ray

    temp_dir = Path(tempfile.mkdtemp(prefix="zsray", dir="/tmp"))
    # Workers are processes of the raylet, which takes the driver's environment at start.
    env = {**WORKER_ENV, **RAY_ENV,
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        ray.init(num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, _temp_dir=str(temp_dir),
                 include_dashboard=False, log_to_driver=False)
    except BaseException:
        _restore(before)
        raise
    return Cluster(temp_dir, ray.get_runtime_context().gcs_address, storage, before)


def _restore(env: dict[str, str | None]) -> None:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def leftovers(cluster: Cluster) -> list[str]:
    """Command lines of processes still running from this Ray instance (its temp dir)."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line.strip()[:160] for line in ps.splitlines() if str(cluster.temp_dir) in line]


def stop(cluster: Cluster) -> list[str]:
    """``ray.shutdown``; returns what was left running (then killed) as the test's finding."""
    import ray

    ray.shutdown()
    _restore(cluster.env_before)
    left = leftovers(cluster)
    for line in left:
        os.kill(int(line.split()[0]), 9)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    return left


def fit(cluster: Cluster, train_func: Any, config: dict[str, Any], name: str, *,
        workers: int = 2, max_failures: int = 0) -> Any:
    """One ``TorchTrainer`` job (CPU workers, gloo); the run's result (its error raised).
    A job with the ``name`` of an earlier one continues that run from its latest
    checkpoint, with ``workers`` workers."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_func, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=str(cluster.storage),
                             failure_config=FailureConfig(max_failures=max_failures)))
    return trainer.fit()


def checkpoints(cluster: Cluster, name: str) -> list[Path]:
    """The run's checkpoint directories in the order they were reported (Ray names them by
    their time)."""
    return sorted(p for p in (cluster.storage / name).glob("checkpoint_*") if p.is_dir())


def files(folder: Path) -> dict[str, int]:
    """Every regular file under ``folder``, relative, with its size."""
    return {str(p.relative_to(folder)): p.stat().st_size
            for p in sorted(folder.rglob("*")) if p.is_file()}
