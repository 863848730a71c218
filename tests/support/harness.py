"""Run many distributed scenarios in one set of worker processes sharing one gloo group.

A scenario module registers functions with ``@scenario`` (or ``register``); ``run_world``
starts ``world_size`` workers like torchrun would, each runs every scenario in order on the
same process group, and rank results come back as JSON. Tests then assert on the results, so
spawning costs once per module and world size rather than once per assertion.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

SCENARIOS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {}
ROOT = Path(__file__).resolve().parents[2]
# Imported once per pytest session by a fork server; every world's workers are forked from it
# (new processes, a new gloo group each) instead of paying ~5 s of CPU per process for torch,
# dynamo (torch.optim imports it) and the package: about a minute of the suite on 2 cores.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zero_strategy", "tests.support.harness",
           "tests.support.models"]
# Read by the C library or CUDA when a process starts: worlds that set them get a fresh
# interpreter, as before.
_FRESH_ONLY = ("MALLOC_", "ZS_BACKEND", "CUDA_")


def register(name: str, fn: Callable[..., Any], **kwargs: Any) -> None:
    if name in SCENARIOS:
        raise ValueError(f"scenario {name!r} registered twice")
    SCENARIOS[name] = (fn, kwargs)


def scenario(fn: Callable[..., Any]) -> Callable[..., Any]:
    register(fn.__name__, fn)
    return fn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(module_file: str, world_size: int, timeout: float = 500.0,
              env: dict[str, str] | None = None) -> dict[str, list[Any]]:
    """{scenario name: [result of rank 0, rank 1, ...]}; a failed scenario's result is
    {"error": traceback}."""
    out_dir = tempfile.mkdtemp(prefix="zs-world-")
    try:
        return _run_in(out_dir, module_file, world_size, timeout, env)
    finally:
        # Scenarios write checkpoints and saved models (hundreds of MiB) through tempfile;
        # TMPDIR points them here, so a world that fails or is killed leaves nothing behind
        # (leaked model folders once filled the disk under CI).
        shutil.rmtree(out_dir, ignore_errors=True)


def _run_in(out_dir: str, module_file: str, world_size: int, timeout: float,
            env: dict[str, str] | None) -> dict[str, list[Any]]:
    scratch = Path(out_dir, "tmp")
    scratch.mkdir()
    port = str(_free_port())
    envs = [{
        **os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "TMPDIR": str(scratch),
        **(env or {}),
    } for rank in range(world_size)]
    fresh = any(k.startswith(_FRESH_ONLY) for k in env or {})
    start = _start_fresh if fresh else _start_forked
    logs = start(module_file, out_dir, envs, timeout)
    results: dict[str, list[Any]] = {}
    for rank in range(world_size):
        path = Path(out_dir, f"rank{rank}.json")
        if not path.exists():
            raise RuntimeError(f"rank {rank} wrote no results; logs:\n" + "\n".join(
                f"--- rank {r}\n{log[-6000:]}" for r, log in enumerate(logs)))
        for name, value in json.loads(path.read_text()).items():
            results.setdefault(name, []).append(value)
    return results


def _start_fresh(module_file: str, out_dir: str, envs: list[dict[str, str]],
                 timeout: float) -> list[str]:
    procs = [subprocess.Popen([sys.executable, __file__, str(ROOT / module_file), out_dir],
                              env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for e in envs]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append(p.communicate()[0])
    return logs


def _start_forked(module_file: str, out_dir: str, envs: list[dict[str, str]],
                  timeout: float) -> list[str]:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    log_files = [Path(out_dir, f"log{rank}.txt") for rank in range(len(envs))]
    procs = [context.Process(target=_forked_worker,
                             args=(str(ROOT / module_file), out_dir, e, str(log)))
             for e, log in zip(envs, log_files)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [f.read_text() if f.exists() else "" for f in log_files]


def _forked_worker(module_file: str, out_dir: str, env: dict[str, str], log: str) -> None:
    """A world's process, forked from the preloaded server: its own environment and log."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the fork server cached its own; read this world's TMPDIR again
    try:
        _worker(module_file, out_dir)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _worker(module_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = os.environ.get("ZS_BACKEND", "gloo")
    if backend != "gloo":  # nccl, or gloo on CUDA tensors ("cpu:gloo,cuda:gloo")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    spec = importlib.util.spec_from_file_location("scenarios", module_file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    path = Path(out_dir, f"rank{rank}.json")
    # Debugging aids: ZS_ONLY=prefix,... runs only those scenarios; ZS_SCENARIO_TIMES=file
    # appends each scenario's seconds on rank 0 (what makes a world slow).
    only = [p for p in os.environ.get("ZS_ONLY", "").split(",") if p]
    times = os.environ.get("ZS_SCENARIO_TIMES") if rank == 0 else None
    for name, (fn, kwargs) in SCENARIOS.items():
        if only and not any(name.startswith(p) for p in only):
            continue
        dist.barrier()
        started = time.perf_counter()
        try:
            results[name] = fn(**kwargs)
        except Exception:  # recorded per scenario; the test for it reports the traceback
            results[name] = {"error": traceback.format_exc()}
        path.write_text(json.dumps(results))  # partial results survive a later hang
        if times:
            record_time(times, time.perf_counter() - started,
                        f"{Path(module_file).stem} N={dist.get_world_size()} {name}")
    dist.barrier()
    dist.destroy_process_group()


def record_time(path: str, seconds: float, what: str) -> None:
    """One line of ``ZS_SCENARIO_TIMES``: a scenario's seconds, then what it was."""
    with open(path, "a") as f:
        f.write(f"{seconds:8.2f} {what}\n")


def check(result: list[Any]) -> list[Any]:
    """The per-rank results of a scenario, failing with the worker's traceback if any."""
    for rank, value in enumerate(result):
        if isinstance(value, dict) and "error" in value:
            raise AssertionError(f"rank {rank} failed:\n{value['error']}")
    return result


if __name__ == "__main__":
    # Scenario modules import the registry as tests.support.harness: make that this module.
    sys.modules["tests.support.harness"] = sys.modules["__main__"]
    _worker(sys.argv[1], sys.argv[2])
