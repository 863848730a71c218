"""Starting a job's workers: torch.distributed.run's agent, either as its own interpreter
(``trainer.preload=false``: ``python -m torch.distributed.run ... -m recipes.worker job.yaml``) or
forked from the Hydra process after it imported what every worker imports and prepared the
data once (``trainer.preload=true``, the default).

Where a job's start-up went, measured with the timestamps each rank writes to metrics.json
(``startup_s``, seconds since the Hydra process began the job; 2 cores, gpt-tiny): as fresh
interpreters, ~2 s until the agent had started the workers, ~5-10 s of imports in each
worker (torch, Lightning with torchmetrics and torch._dynamo, transformers, zero_strategy),
~1 s training the BPE tokenizer in each worker, then process-group init and Lightning's
setup. Preloaded, the agent is a fork (no interpreter, no imports), the workers are forks
of it (imports done, the token stream already in memory), and a job reaches its first batch
in about the time of the process-group init and Lightning's setup.

Each job is still its own world: fresh worker processes and a fresh process group per job,
under the same agent (rendezvous, ``--max-restarts``, failure reports) as torchrun's.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recipes import lifetime

if TYPE_CHECKING:
    from recipes.rendezvous import Rendezvous



MODEL_CLASSES = {"gpt": "GPT2LMHeadModel", "bert": "BertForMaskedLM",
                 "resnet": "ResNetForImageClassification"}


def torchrun_args(nproc: int, max_restarts: int, config_file: Path,
                  rendezvous: Rendezvous | None = None) -> list[str]:
    """One node on its own (``--standalone``), or this node's part of a job across nodes."""
    nodes = rendezvous.torchrun_args() if rendezvous is not None else ["--standalone"]
    return [*nodes, "--nproc_per_node", str(nproc), "--max-restarts", str(max_restarts),
            "--module", "recipes.worker", str(config_file)]


def preload(data_cfg: dict[str, Any], model_cfg: dict[str, Any]) -> None:
    """Imports every worker module and prepares the job's data in this (the Hydra) process,
    once per process and data config: forked workers inherit both."""
    import torch

    check_cuda_untouched("before this job was preloaded (this process's earlier code)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no Rust threads before forks
    from recipes import data

    check_cuda_untouched("importing recipes/data.py")
    import transformers

    check_cuda_untouched("importing transformers")
    from recipes import worker  # noqa: F401  (its imports are the workers')

    check_cuda_untouched("importing recipes/worker.py and what it imports")
    # transformers loads a model's code on first access to its class.
    getattr(transformers, MODEL_CLASSES.get(model_cfg["name"], "PreTrainedModel"))
    check_cuda_untouched(f"loading transformers' {model_cfg['name']} model code")
    if data_cfg["kind"] in ("causal", "masked"):
        data.token_stream(int(data_cfg["vocab_size"]))  # memoised
        check_cuda_untouched("preparing the data")


def check_cuda_untouched(what: str) -> None:
    """Refuse to fork workers from a process holding a CUDA context: a forked child cannot
    use CUDA (its first CUDA call fails, "Cannot re-initialize CUDA in forked subprocess"),
    and the error would surface in every worker, far from its cause."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(
            f"CUDA was initialised in the Hydra process ({what}), so workers forked from it "
            "could not use CUDA. Run the job with trainer.preload=false: its workers then "
            "start as new interpreters")


def run_subprocess(argv: list[str], env: dict[str, str], timeout_s: int) -> int | str:
    """torch.distributed.run as its own interpreter; Ctrl-C or SIGTERM to this process stop
    it (and it its workers), and it dies with this process (``lifetime.py``)."""
    parent = os.getpid()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv], env=env,
                            preexec_fn=lambda: lifetime.child_of(parent))
    return _wait(proc.pid, lambda: proc.poll() is not None, lambda t: _poll(proc, t),
                 lambda: proc.send_signal(signal.SIGTERM), proc.kill, timeout_s,
                 lambda: proc.returncode)


def run_forked(argv: list[str], env: dict[str, str], timeout_s: int) -> int | str:
    """torch.distributed.run's agent in a forked child (its own session, so a timeout ends
    it and its workers together), starting the workers by fork with worker.main. Ctrl-C or
    SIGTERM to this process stop the job; the agent dies with this process (``lifetime.py``)."""
    check_cuda_untouched("between preloading and starting the job")
    agent = multiprocessing.get_context("fork").Process(
        target=_agent, args=(argv, env, os.getpid()), name="recipes-agent")
    agent.start()
    assert agent.pid is not None
    pid = agent.pid
    return _wait(pid, lambda: agent.exitcode is not None, agent.join,
                 lambda: os.kill(pid, signal.SIGTERM),
                 lambda: lifetime.signal_group(pid, signal.SIGKILL), timeout_s,
                 lambda: agent.exitcode)


def _poll(proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        pass


def _wait(pid: int, done: Any, wait: Any, stop: Any, kill: Any, timeout_s: int,
          exitcode: Any) -> int | str:
    """Wait for the agent (``pid``): at most ``timeout_s`` ("timeout": killed), or, after
    Ctrl-C/SIGTERM here, ``lifetime.GRACE_S`` for its orderly stop (then killed); then this
    process stops as the signal asks."""
    deadline = time.monotonic() + timeout_s
    with lifetime.stop_on_signals(stop) as stopping:
        while not done():
            if time.monotonic() > deadline or stopping.overdue():
                kill()
                wait(None)
                if not stopping:
                    return "timeout"
                break
            wait(0.5)
    stopping.finish()
    return exitcode()


def _agent(argv: list[str], env: dict[str, str], parent: int) -> None:
    os.setsid()
    # SIGTERM, which the agent handles by stopping its workers, when the launcher dies.
    lifetime.child_of(parent)
    os.environ.clear()
    os.environ.update(env)
    import uuid

    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    from recipes import worker

    args = torchrun.parse_args(["--start-method", "fork", *argv])
    if args.standalone:  # what torchrun's --standalone does before building its config
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    config, _, _ = torchrun.config_from_args(args)  # its command is the interpreter's
    try:
        elastic_launch(config=config, entrypoint=worker.main)(*args.training_script_args)
    except Exception:  # the agent's failure report (which rank, exit code), as torchrun's
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
