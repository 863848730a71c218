"""Runs one Hydra job as its own multi-process world and collects what it measured."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from recipes import agent, rendezvous


def job_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # called outside a Hydra app (tests)
        return Path.cwd()


def check_job(cfg: DictConfig) -> None:
    """What a worker would refuse, refused here before any worker starts: the precision and
    optimizer names, and the strategy's options as ZeroConfig reads them (names and values)."""
    from recipes import schema

    if cfg.precision.name not in schema.PRECISIONS:
        raise ValueError(f"precision.name={cfg.precision.name!r} is not one of "
                         f"{list(schema.PRECISIONS)}")
    if cfg.optim.name not in schema.OPTIMIZERS:
        raise ValueError(f"optim.name={cfg.optim.name!r} is not one of {list(schema.OPTIMIZERS)}")
    readable = schema.DATA_FOR_MODEL.get(str(cfg.model.name), ())
    if cfg.data.kind not in readable:
        raise ValueError(
            f"data.kind={cfg.data.kind!r} with model={cfg.model.name}: the model reads data of "
            f"kind {list(readable)}; choose a data option of that kind (data={cfg.model.name} "
            "is the matching one, the default)")
    metric = cfg.get("optimized_metric")
    if metric is not None:
        if metric not in schema.OBJECTIVES:
            raise ValueError(f"optimized_metric={metric!r} is not one of {list(schema.OBJECTIVES)}")
        if metric == "val_acc" and cfg.model.name != "resnet":
            raise ValueError(f"optimized_metric='val_acc' is measured for model=resnet only, "
                             f"not model={cfg.model.name}; use val_loss")
        if metric.startswith("val_") and int(cfg.trainer.limit_val_batches) <= 0:
            raise ValueError(f"optimized_metric={metric!r} needs validation, but "
                             f"trainer.limit_val_batches={cfg.trainer.limit_val_batches} runs "
                             "none; set it to 1 or more")
    check_strategy(cfg)
    if str(cfg.launcher.name) == "ray":
        if importlib.util.find_spec("ray") is None:
            raise ValueError("launcher=ray runs each job as a Ray Train job and needs Ray, "
                             "which is not installed: pip install \"zero-strategy[ray]\"")
    else:  # Ray places the workers of every node itself: no rendezvous to configure
        rendezvous.check_nodes(cfg.trainer)
    from recipes.resume import resume_source

    resume_source(cfg.trainer.get("resume_from"))  # a path that is no checkpoint: refused now


def job_number() -> int | None:
    """The job's number in a multirun (the same on every node running the sweep), None for a
    single run or outside Hydra."""
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:
        return None
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return int(hydra_cfg.job.num)


def save_config(cfg: DictConfig, path: Path) -> None:
    """Written whole or not at all: with several nodes sharing the job directory, each node's
    Hydra process writes the same file while the other's workers may be reading it."""
    tmp = path.with_name(f".{path.name}.{rendezvous.LAUNCHER_ID.replace(':', '-')}")
    OmegaConf.save(cfg, tmp, resolve=True)
    os.replace(tmp, path)


def check_strategy(cfg: DictConfig) -> None:
    """The strategy's keys as its implementation reads them: ZeroConfig's fields under
    ``strategy.zero`` for zero_strategy; for DDP and the anchors (Lightning's FSDP and
    DeepSpeed strategies) only a stage they have, and no ``strategy.zero`` keys (they would
    be silently ignored)."""
    from recipes import schema

    s, impl = cfg.strategy, str(cfg.strategy.impl)
    if impl == "zero":
        from zero_strategy.config import ZeroConfig

        if s.offload:
            raise ValueError(f"strategy.offload is for the anchors (fsdp, deepspeed); "
                             f"strategy={s.name} offloads with strategy.zero.offload_optimizer "
                             "and strategy.zero.offload_params")
        # The workers' ZeroStrategy(stage=..., **strategy.zero) builds it the same way.
        ZeroConfig.from_options({"stage": s.stage, "precision": str(cfg.precision.name),
                                 **schema.zero_options(s.zero)}, source="strategy.zero")
        return
    stray = sorted(schema.zero_options(s.zero))
    if stray:
        raise ValueError(
            f"strategy.zero.{stray[0]}: strategy={s.name} is Lightning's "
            f"{ANCHOR_CLASS[impl]}, which does not read zero_strategy's options "
            f"(strategy.zero.*); remove them, or pick a zero* strategy")
    stages = ANCHOR_STAGES[impl]
    if s.stage not in stages:
        raise ValueError(f"strategy.stage={s.stage} with strategy.impl={impl}: allowed "
                         f"{list(stages)}")
    if impl == "ddp":
        if s.offload:
            raise ValueError("strategy.offload=true with strategy.impl=ddp: DDP has no offload")
        return
    if cfg.optim.name != "adamw":
        raise ValueError(f"optim.name={cfg.optim.name!r} with strategy={s.name}: the anchors "
                         "train with AdamW only (Muon needs whole matrices, which FSDP's and "
                         "DeepSpeed's flat shards cut); use optim=adamw")
    if impl == "deepspeed":
        from recipes.anchors import deepspeed_missing

        missing = deepspeed_missing()
        if missing is not None:
            raise ValueError(f"strategy={s.name}: {missing}")
        if cfg.trainer.accelerator == "cpu" and shutil.which("c++") is None:
            # DS_ACCELERATOR=cpu compiles its shared-memory communication op when the
            # process group starts, and the offload presets its CPU Adam, on first use.
            raise ValueError(f"strategy={s.name}: DeepSpeed on CPU compiles C++ ops on first "
                             "use (shm_comm; cpu_adam for offload) and no C++ compiler (c++) "
                             "is on PATH; install one (apt-get install g++)")


ANCHOR_CLASS = {"ddp": "DDPStrategy", "fsdp": "FSDPStrategy", "deepspeed": "DeepSpeedStrategy"}
ANCHOR_STAGES: dict[str, tuple[int | None, ...]] = {
    "ddp": (None,), "fsdp": (2, 3), "deepspeed": (1, 2, 3)}


def run_job(cfg: DictConfig, out: Path | None = None) -> float:
    started = time.time()
    check_job(cfg)
    out = out or job_dir()
    out.mkdir(parents=True, exist_ok=True)
    # A worker that dies (process or node lost) makes torch.distributed.run (or Ray) restart
    # them all; they resume from the job's last checkpoint (worker.py).
    ray = str(cfg.launcher.name) == "ray"
    nodes = None if ray else rendezvous.job_rendezvous(cfg.trainer, str(cfg.name), job_number())
    if nodes is not None and int(cfg.trainer.num_nodes) != nodes.nnodes:
        with open_dict(cfg):  # a SLURM allocation's nodes: the workers' Trainer needs them
            cfg.trainer.num_nodes = nodes.nnodes
    config_file = out / "job.yaml"
    save_config(cfg, config_file)
    nproc = int(cfg.trainer.devices)
    env = {**os.environ, "ZS_JOB_T0": repr(started), "ZS_LAUNCHER_ID": rendezvous.LAUNCHER_ID,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           # A restarted attempt must not share the launcher's store with the failed one:
           # it would read the dead workers' addresses and fail (or hang) connecting
           # (pytorch/pytorch#135712).
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if str(cfg.strategy.impl) == "deepspeed" and cfg.trainer.accelerator == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator
    if ray:
        from recipes import ray_job

        print(f"[{cfg.name}] {nproc * int(cfg.trainer.num_nodes)} Ray Train workers", flush=True)
        code: int | str = ray_job.run(cfg, config_file, env, out)
        return finish_job(cfg, out, config_file, code)
    argv = agent.torchrun_args(nproc, int(cfg.trainer.max_restarts), config_file, nodes)
    how = "forked from this preloaded process" if cfg.trainer.preload else "new interpreters"
    where = f" on this node of {nodes.nnodes}" if nodes is not None else ""
    print(f"[{cfg.name}] {nproc} processes{where}: torch.distributed.run {' '.join(argv)} "
          f"({how})", flush=True)
    if cfg.trainer.preload:
        agent.preload(OmegaConf.to_container(cfg.data), OmegaConf.to_container(cfg.model))
        code = agent.run_forked(argv, env, int(cfg.trainer.timeout_s))
    else:
        code = agent.run_subprocess(argv, env, int(cfg.trainer.timeout_s))
    return finish_job(cfg, out, config_file, code)


def finish_job(cfg: DictConfig, out: Path, config_file: Path, code: int | str) -> float:
    """The job's measurements, printed and returned to Hydra; a failed job raises."""
    metrics_file = out / "metrics.json"
    if code != 0 or not metrics_file.exists():
        raise RuntimeError(f"job {cfg.name!r} failed (exit {code}); its output is above, its "
                           f"config in {config_file}")
    metrics = json.loads(metrics_file.read_text())
    print(summary(metrics), flush=True)
    return objective(metrics, cfg.get("optimized_metric"))


def objective(metrics: dict, metric: str | None) -> float:
    """What the job returns to Hydra: the value of ``optimized_metric`` (a sweeper such as
    Optuna ranks trials by it). Without one set, the val loss, NaN when there is none (nobody
    reads it). With one set, a missing or non-finite value fails the job (Optuna records the
    trial as failed) with the metric named and the reason, instead of handing the sweeper a
    NaN it cannot rank."""
    if metric is None:
        return float(metrics.get("val_loss", float("nan")))
    value = metrics.get(metric)
    job = metrics.get("name", "?")
    if value is None or (metric.startswith("val_") and metrics.get("val_step") is None):
        reason = ("no validation ran (trainer.limit_val_batches=0 or an empty validation set)"
                  if metric.startswith("val_") else "the job recorded none")
        raise RuntimeError(f"job {job!r} has no {metric} to return as optimized_metric: "
                           f"{reason}; the trial fails")
    if not math.isfinite(float(value)):
        raise RuntimeError(
            f"job {job!r}: {metric} is {value} after {metrics.get('steps')} steps (training "
            "diverged: lower optim.lr or its search range), not a value a sweeper can rank; "
            "the trial fails")
    return float(value)


def summary(m: dict) -> str:
    mib = 2.0**20
    lines = [f"[{m['name']}] {m['strategy']} x{m['world_size']}: "
             f"loss {m['first_loss']:.3f} -> {m['train_loss']:.3f} (val {m['val_loss']:.3f}"
             + (f", val acc {m['val_acc']:.1%}" if m.get("val_acc") is not None else "") + "), "
             f"{m['samples_per_s']:.1f} samples/s, {m['tokens_per_s']:.0f} tokens/s, "
             + (f"{m['comm_bytes_per_step'] / mib:.2f} MiB sent/step/rank"
                if m["comm_bytes_per_step"] is not None else "bytes sent not measured")]
    for r in m["ranks"]:
        lines.append(f"  rank {r['rank']}: peak RSS +{r['peak_rss_mib']:.0f} MiB, model states "
                     f"{r['model_state_bytes'] / mib:.2f} MiB (ZeRO formula "
                     f"{r['predicted_bytes'] / mib:.2f} MiB)" + activations(r))
    return "\n".join(lines)


def activations(rank: dict) -> str:
    """The rank's activation bytes, measured (where the engine measures them) beside the
    activation formula's saved bytes and backward peak; empty when neither is known."""
    mib = 2.0**20
    measured, predicted = rank.get("activation_bytes"), rank.get("predicted_activation_bytes")
    if measured is None and predicted is None:
        return ""
    parts = [f"{measured / mib:.2f} MiB measured"] if measured is not None else []
    if predicted is not None:
        parts.append(f"formula {predicted / mib:.2f} MiB, backward peak "
                     f"{rank['predicted_activation_peak_bytes'] / mib:.2f} MiB")
    return ", activations " + " (".join(parts) + (")" if len(parts) == 2 else "")
