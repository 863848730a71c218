"""One training loop launched by torchrun and as a Ray Train job: the start-up (from the
launch to the first step) and the time per step of each, one run of each, the same code.

    python bench/ray_launch.py [--workers 2] [--steps 20] [--out ray_launch.json]

The loop: ``ZeroEngine`` at stage 3 with AdamW on a 1.8M-parameter MLP (the model of
tests/worlds/ray_engine.py), 8 samples per worker per step, gloo. Each rank stamps the wall
clock when its first step begins and when every step ends; rank 0 writes them. Start-up is
measured from just before the launch (``subprocess`` running torchrun; ``TorchTrainer.fit``
on a Ray already started, as on a cluster) to rank 0's first step; ``ray.init`` of the local
Ray is timed apart. A step's time is the median of the steps after the first two.
Needs the ``ray`` extra. Run time: about a minute on 2 quiet cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WARMUP = 2
"""Steps left out of the per-step median: the first allocates the engine's buffers."""


def train(steps: int, t0: float, record: Path) -> None:
    """The loop, on the process group already made (torchrun's or Ray's)."""
    import torch
    import torch.distributed as dist

    import zero_strategy as zs

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = 768
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 5))
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           zs.ZeroConfig(stage=3, unit_numel=200_000))
    g = torch.Generator().manual_seed(dist.get_rank())
    first = time.time()
    ends = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.zero_grad()
        ends.append(time.time())
    if dist.get_rank() == 0:
        record.write_text(json.dumps({"t0": t0, "first_step": first, "ends": ends,
                                      "world": dist.get_world_size()}))


def summary(record: dict[str, Any]) -> dict[str, float]:
    ends = record["ends"]
    steps = [b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1:])]
    return {"startup_s": round(record["first_step"] - record["t0"], 2),
            "step_s": round(statistics.median(steps), 4)}


def under_torchrun(workers: int, steps: int, folder: Path) -> dict[str, float]:
    record = folder / "torchrun.json"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(workers), __file__, "--worker", "--steps",
                    str(steps), "--t0", repr(t0), "--record", str(record)], check=True)
    return summary(json.loads(record.read_text()))


def _ray_train_func(config: dict[str, Any]) -> None:
    train(config["steps"], config["t0"], Path(config["record"]))


def under_ray(workers: int, steps: int, folder: Path) -> dict[str, float]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    temp = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # short: Ray's socket paths live here
    started = time.time()
    ray.init(num_cpus=workers, object_store_memory=100 * 2**20, include_dashboard=False,
             _temp_dir=temp, log_to_driver=False)
    init_s = time.time() - started
    try:
        record = folder / "ray.json"
        t0 = time.time()
        TorchTrainer(_ray_train_func,
                     train_loop_config={"steps": steps, "t0": t0, "record": str(record)},
                     scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                     run_config=RunConfig(name="ray_launch", storage_path=str(folder))).fit()
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    return {"ray_init_s": round(init_s, 2), **summary(json.loads(record.read_text()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        train(args.steps, args.t0, args.record)
        return
    # torchrun's and Ray's workers import this checkout's package, one thread each
    checkout = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [checkout,
                                                             os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.steps <= WARMUP + 1:
        parser.error(f"--steps must be over {WARMUP + 1} (the first {WARMUP} are not timed)")
    with tempfile.TemporaryDirectory(prefix="ray_launch") as folder:
        result = {"workers": args.workers, "steps": args.steps,
                  "load_before": os.getloadavg()[0],
                  "torchrun": under_torchrun(args.workers, args.steps, Path(folder)),
                  "ray": under_ray(args.workers, args.steps, Path(folder)),
                  "load_after": os.getloadavg()[0]}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
