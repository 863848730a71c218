"""The same fine-tuning run through ``transformers.Trainer`` four ways: under DDP, with
DeepSpeed ZeRO-3 (``deepspeed=``), with FSDP (``fsdp="full_shard"``), and as ``ZeroTrainer``
at stage 3; and the peak memory of loading a pretrained model whole against streaming it
into the shards.

A GPT-2 built from a config (random weights, seeded) is written with ``save_pretrained``
into a temporary folder; each system is then one ``torch.distributed.run`` of this script's
worker mode, which loads that folder, trains it (fp32, AdamW, CPU processes over gloo) and
writes one record per rank. The parent prints a markdown table and can write it as a page::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python bench/trainer_bench.py \\
        --page docs/performance/trainer-2026-11-27.md

bench/README.md ("Trainer integrations") says what every figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SEED = 1234
MIB = 1024  # ru_maxrss is in KiB on Linux
TRAIN_SYSTEMS = ("ddp", "deepspeed_zero3", "fsdp_full_shard", "zs_zero3", "zs_zero3_streamed")
LOAD_MODES = ("whole", "whole_sharded", "streamed_engine", "streamed")
# Accelerate's distributed type each system must run under to be what its name says.
EXPECTED_TYPE = {"deepspeed_zero3": "DEEPSPEED", "fsdp_full_shard": "FSDP"}
STREAMED_MISSING = "zero_strategy.transformers.from_pretrained does not exist yet"


@dataclass(frozen=True)
class Shape:
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int  # micro-batch per rank


# ~10M parameters with real activations: ~0.5 s a step on one core per rank.
TRAIN_SHAPE = Shape(layers=4, width=384, heads=6, vocab=8192, seq=128, batch=4)
# 168M parameters (640 MiB in fp32): big enough that a whole copy per rank stands out of the
# interpreter's and torch's own few hundred MiB.
LOAD_SHAPE = Shape(layers=12, width=1024, heads=16, vocab=16384, seq=32, batch=1)


# -- the parent: save the model, launch each system, tabulate -----------------------------------

def save_model(shape: Shape, folder: Path) -> int:
    """A seeded GPT-2 from a config, written with save_pretrained; returns its parameter count."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=shape.layers, n_embd=shape.width, n_head=shape.heads, vocab_size=shape.vocab,
        n_positions=shape.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        use_cache=False, tie_word_embeddings=True,
        # GPT-2's default token ids lie outside a smaller vocabulary
        bos_token_id=shape.vocab - 1, eos_token_id=shape.vocab - 1)
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def launch(worker: str, folder: Path, shape: Shape, opts: argparse.Namespace) -> dict[str, Any]:
    """One torch.distributed.run of the worker; its per-rank records combined into a row, or
    the error that stopped it (a row all the same, so the table shows what did not run)."""
    out = Path(tempfile.mkdtemp(prefix=f"trainer_bench_{worker}_", dir=opts.workdir))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(opts.nproc), __file__, "--worker", worker,
               "--model", str(folder), "--out", str(out), "--shape", json.dumps(asdict(shape)),
               "--warmup", str(opts.warmup), "--steps", str(opts.steps)]
    start = time.perf_counter()
    log, rc, ranks = run_workers(command, out, opts.timeout)
    row = combine(worker, ranks, opts.warmup)
    if "error" not in row and (rc != 0 or len(ranks) != opts.nproc):
        row["error"] = f"exit {rc}: {_last_error(log)}"
    row["wall_s"] = time.perf_counter() - start
    print(f"{worker}: {row.get('error', 'ok')} ({row['wall_s']:.0f} s, log {out}/log.txt)",
          flush=True)
    return row


def run_workers(command: list[str], out: Path, timeout: float
                ) -> tuple[str, int | str, list[dict[str, Any]]]:
    """Run a torchrun ``command`` whose ranks write ``out/rank*.json``: its log (also kept as
    ``out/log.txt``), its exit code (or "timeout T s") and the ranks' results."""
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, env=_worker_env())
        log, rc = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = (e.stdout or b"").decode(errors="replace"), f"timeout {timeout} s"
    (out / "log.txt").write_text(log)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return log, rc, ranks


def _worker_env() -> dict[str, str]:
    # One core per rank as everywhere in bench/; DeepSpeed must be told there is no GPU.
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu"}


def _last_error(log: str) -> str:
    """The last line that names an exception, else the log's last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    named = [ln for ln in lines if ("Error" in ln or "Exception" in ln) and ":" in ln
             and not ln.startswith(("File ", "raise ", "[rank"))]
    return (named or lines or ["no output"])[-1][:300]


def combine(worker: str, ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    row: dict[str, Any] = {"system": worker}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return row | {"error": errors[0]}
    if not ranks:
        return row
    row["ran_as"] = ranks[0].get("ran_as", "")
    wanted = EXPECTED_TYPE.get(worker)
    if wanted and not row["ran_as"].startswith(wanted):
        row["error"] = f"not {wanted}: accelerate ran it as {row['ran_as']} (figures are that)"
    row["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ranks)
    row["growth_mib"] = max(r["growth_mib"] for r in ranks)
    if "step_s" in ranks[0]:
        # A step lasts as long as its slowest rank.
        steps = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
        row["step_s"] = steps
        row["median_s"] = statistics.median(steps[warmup:])
        row["losses"] = ranks[0]["losses"]  # Trainer logs the mean over ranks
    if "held_growth_mib" in ranks[0]:
        row["growth_per_rank"] = [r["growth_mib"] for r in ranks]
        row["held_growth_mib"] = max(r["held_growth_mib"] for r in ranks)
        row["params_mib"] = max(r["params_mib"] for r in ranks)
    return row


def _fmt(row: dict[str, Any], key: str, spec: str) -> str:
    value = row.get(key)
    return "-" if value is None else format(value, spec)


def train_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| system | s/step (median) | peak RSS per rank, MiB (max) | RSS growth, MiB (max) "
             "| first loss | final loss | ran as | error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        losses = r.get("losses") or [None]
        lines.append(
            f"| `{r['system']}` | {_fmt(r, 'median_s', '.3f')} | {_fmt(r, 'peak_rss_mib', '.0f')} "
            f"| {_fmt(r, 'growth_mib', '.0f')} | {_fmt({'v': losses[0]}, 'v', '.4f')} "
            f"| {_fmt({'v': losses[-1]}, 'v', '.4f')} | {r.get('ran_as', '')} "
            f"| {r.get('error', '')} |")
    return "\n".join(lines)


def load_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| loading | peak RSS per rank, MiB (max) | peak RSS growth per rank, MiB "
             "| RSS growth held at the end, MiB (max) | parameters held per rank, MiB "
             "| error |", "|---|---|---|---|---|---|"]
    for r in rows:
        growth = " / ".join(f"{g:.0f}" for g in r.get("growth_per_rank", [])) or "-"
        lines.append(f"| `{r['system']}` | {_fmt(r, 'peak_rss_mib', '.0f')} | {growth} "
                     f"| {_fmt(r, 'held_growth_mib', '.0f')} | {_fmt(r, 'params_mib', '.0f')} "
                     f"| {r.get('error', '')} |")
    return "\n".join(lines)


# -- the worker: one system on one rank ----------------------------------------------------------

def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / MIB


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def token_dataset(shape: Shape, rows: int) -> Any:
    """Random token ids (labels = inputs), the same rows on every rank and in every system;
    Trainer's sampler gives each rank its part."""
    import torch
    from torch.utils.data import Dataset

    class Tokens(Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(SEED)
            self.ids = torch.randint(0, shape.vocab, (rows, shape.seq), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    return Tokens()


def step_timer() -> Any:
    """A callback timing each optimizer step (forward, backward, clipping, optimizer step):
    from Trainer's on_step_begin to its on_step_end, so data loading and logging are out."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.seconds.append(time.perf_counter() - self._start)

    return StepTimer()


def deepspeed_zero3(**zero: Any) -> dict[str, Any]:
    """Trainer's ``deepspeed=`` ZeRO-3 config; "auto" values are filled from the
    TrainingArguments, so the run is the same one as the other systems'."""
    return {"zero_optimization": {"stage": 3, **zero}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "steps_per_print": 10**9}


def write_results(json_path: Path | None, page_path: Path | None, result: dict[str, Any],
                  page: Callable[[dict[str, Any]], str]) -> None:
    """The run as JSON and as a markdown page, where asked for."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    if page_path:
        page_path.parent.mkdir(parents=True, exist_ok=True)
        page_path.write_text(page(result))


def training_arguments(system: str, out: Path, shape: Shape, steps: int) -> Any:
    """The same TrainingArguments for every system but the one field that picks it."""
    from transformers import TrainingArguments

    extra: dict[str, Any] = {}
    if system == "deepspeed_zero3":
        # "auto" values are filled from the arguments below, so the run is the same one; the
        # optimizer is Trainer's own (torch AdamW) since the config names none.
        extra["deepspeed"] = deepspeed_zero3()
    elif system == "fsdp_full_shard":
        # FSDP2 (transformers' default version), one unit per GPT-2 block plus the root.
        extra["fsdp"] = "full_shard"
        extra["fsdp_config"] = {"transformer_layer_cls_to_wrap": ["GPT2Block"]}
    return TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=shape.batch, max_steps=steps,
        learning_rate=1e-4, adam_beta2=0.95, weight_decay=0.1, max_grad_norm=1.0,
        lr_scheduler_type="constant", optim="adamw_torch", logging_steps=1, report_to=[],
        save_strategy="no", seed=SEED, use_cpu=True, ddp_backend="gloo", disable_tqdm=True,
        dataloader_drop_last=True, **extra)


def load_model(system: str, folder: Path) -> Any:
    from transformers import GPT2LMHeadModel

    if system == "zs_zero3_streamed":
        return streamed_model(folder)
    # Under deepspeed_zero3 the TrainingArguments built before this make from_pretrained load
    # inside deepspeed.zero.Init (partitioned as it loads): DeepSpeed's own streamed loading.
    return GPT2LMHeadModel.from_pretrained(folder, attn_implementation="sdpa").train()


def streamed_model(folder: Path) -> Any:
    """GPT-2 on the meta device, registered so that the engine reads each rank's shards of
    ``folder`` when it is built: ``zero_strategy.transformers.from_pretrained``, else the
    module that defines it (``zero_strategy/integrations/hf/pretrained.py``) while it is not
    exported yet. Called as ``from_pretrained(model_class, path, **kwargs)``."""
    from transformers import GPT2LMHeadModel

    import zero_strategy.transformers as zt

    loader = getattr(zt, "from_pretrained", None)
    if loader is None:
        try:
            from zero_strategy.integrations.hf.pretrained import from_pretrained as loader
        except ImportError as e:
            raise RuntimeError(f"{STREAMED_MISSING} ({e})") from e
    return loader(GPT2LMHeadModel, folder, attn_implementation="sdpa").train()


def make_trainer(system: str, model: Any, args: Any, data: Any, timer: Any) -> Any:
    from transformers import Trainer

    kwargs = {"model": model, "args": args, "train_dataset": data, "callbacks": [timer]}
    if system.startswith("zs_"):
        from zero_strategy.transformers import ZeroPlugin, ZeroTrainer

        return ZeroTrainer(zero_plugin=ZeroPlugin(stage=3), **kwargs)
    return Trainer(**kwargs)


def _import_system(system: str) -> None:
    """The system's library, imported before the memory baseline: its code is not training
    data, nor is transformers' model code."""
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401

    if system.startswith("deepspeed"):
        import deepspeed  # noqa: F401
    elif system.startswith(("zs_", *LOAD_MODES)):  # the load modes shard with our engine
        import zero_strategy.transformers  # noqa: F401
    elif system.startswith("fsdp"):
        import torch.distributed.fsdp  # noqa: F401


def worker_train(system: str, folder: Path, out: Path, shape: Shape, steps: int) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    _import_system(system)
    args = training_arguments(system, out / "trainer", shape, steps)
    args.device  # noqa: B018  (sets up the process group now, before the baseline)
    base = _maxrss_mib()
    model = load_model(system, folder)
    data = token_dataset(shape, rows=steps * shape.batch * args.world_size)
    timer = step_timer()
    trainer = make_trainer(system, model, args, data, timer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    peak = _maxrss_mib()
    return {"step_s": timer.seconds, "losses": losses, "peak_rss_mib": peak,
            "growth_mib": peak - base, "base_rss_mib": base, "ran_as": ran_as(trainer)}


def ran_as(trainer: Any) -> str:
    """Accelerate's distributed type and the wrapper Trainer trained: a system can be asked
    for and not be used (accelerate keeps DDP for fsdp= on CPU processes)."""
    kind = trainer.accelerator.distributed_type
    return f"{getattr(kind, 'value', kind)} / {type(trainer.model_wrapped).__name__}"


def _shard(model: Any, **kwargs: Any) -> Any:
    import torch

    import zero_strategy as zs

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return zs.ZeroEngine(model, optimizer, zs.ZeroConfig(stage=3), **kwargs)


def _rss_now_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / MIB


def _load(mode: str, folder: Path) -> tuple[Any, Any]:
    """The model as ``mode`` loads it, and the engine sharding it (None for ``whole``)."""
    import torch
    from transformers import AutoConfig, GPT2LMHeadModel

    if mode == "streamed":
        return None, _shard(streamed_model(folder))
    if mode == "streamed_engine":
        with torch.device("meta"):
            model = GPT2LMHeadModel(AutoConfig.from_pretrained(folder))
        engine = _shard(model, param_init_fn=model._init_weights)
        # The tied lm_head.weight is not in the folder: it is the embedding, loaded as such.
        engine.load_pretrained(folder, strict=False)
        return model, engine
    model = GPT2LMHeadModel.from_pretrained(folder)
    if mode == "whole":
        # transformers maps the safetensors file and reads a page when a weight is first
        # used: touch every weight, as the first forward would, so the copy is resident.
        with torch.no_grad():
            for p in model.parameters():
                p.sum()
        return model, None
    return model, _shard(model)


def worker_load(mode: str, folder: Path) -> dict:
    """Load only, no step: ``whole`` is from_pretrained on every rank (weights then read);
    ``whole_sharded`` the same then sharded by ZeroEngine at stage 3; ``streamed_engine``
    builds on meta and reads the folder into the shards with ``engine.load_pretrained``;
    ``streamed`` is ``zero_strategy.transformers.from_pretrained`` then the engine."""
    import torch.distributed as dist

    _import_system(mode)
    dist.init_process_group("gloo")
    base = _maxrss_mib()
    model, engine = _load(mode, folder)
    dist.barrier()
    peak = _maxrss_mib()
    held = engine.memory_report()["params_bytes"] / 2**20 if engine is not None else (
        sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20)
    return {"peak_rss_mib": peak, "growth_mib": peak - base,
            "held_growth_mib": _rss_now_mib() - base, "params_mib": held}


def worker(opts: argparse.Namespace) -> None:
    shape = Shape(**json.loads(opts.shape))
    try:
        if opts.worker in TRAIN_SYSTEMS:
            record = worker_train(opts.worker, opts.model, opts.out, shape,
                                  opts.warmup + opts.steps)
        else:
            record = worker_load(opts.worker, opts.model)
    except Exception as e:  # recorded, so the table says why a system did not run
        traceback.print_exc()
        record = {"error": f"{type(e).__name__}: {e}".replace("\n", " ")[:300]}
    (opts.out / f"rank{_rank()}.json").write_text(json.dumps(record))


# -- main --------------------------------------------------------------------------------------

def page(opts: argparse.Namespace, train: str, load: str, minutes: float, n: dict) -> str:
    t, lo = TRAIN_SHAPE, LOAD_SHAPE
    versions = _versions()
    notes = "".join(f"- Note: {n}\n" for n in opts.note)
    return f"""# Trainer integrations, {time.strftime('%Y-%m-%d')}

The same fine-tuning run through `transformers.Trainer` four ways, and the memory of loading
a pretrained model whole or streamed into the shards (`bench/trainer_bench.py`; what every
figure means: `bench/README.md`, "Trainer integrations").

- Command: `{opts.command}`
- Machine: the 2-core development machine, {opts.nproc} processes with one core each
  (`OMP_NUM_THREADS=1`), gloo, fp32; shared with other jobs while it ran, so figures compare
  within this run only, and the step times are noisy (1-minute load average
  {opts.load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end). {platform.machine()},
  {versions}.
- Run time: {minutes:.1f} min in all.
{notes}
## Training

GPT-2 from a config ({t.layers} layers, width {t.width}, vocab {t.vocab}, sequence {t.seq},
{n['train'] / 1e6:.1f}M parameters), saved with `save_pretrained` and loaded with
`GPT2LMHeadModel.from_pretrained` by every system; micro-batch {t.batch} per rank, AdamW
(lr 1e-4, betas (0.9, 0.95), weight decay 0.1), clipping at 1.0, constant lr;
{opts.warmup} warm-up steps, then the median of {opts.steps} timed steps (slowest rank).

{train}

## Loading a pretrained model

GPT-2 with {lo.layers} layers, width {lo.width}, vocab {lo.vocab}
({n['load'] / 1e6:.0f}M parameters, {n['load'] * 4 / 2**20:.0f} MiB in fp32); no training.

{load}
"""


def _versions() -> str:
    import importlib.metadata as md

    names = ("torch", "transformers", "accelerate", "deepspeed")
    found = []
    for name in names:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(found)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(TRAIN_SYSTEMS))
    p.add_argument("--loads", default=",".join(LOAD_MODES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    p.add_argument("--workdir", default=None, help="where models and logs go (a temp folder)")
    p.add_argument("--page", type=Path, help="write the tables as this markdown page")
    p.add_argument("--json", type=Path, help="write every row as JSON")
    p.add_argument("--note", action="append", default=[],
                   help="a line for the page: what was special about the machine or the run")
    # the worker's side
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    opts = parse()
    if opts.worker:
        return worker(opts)
    opts.command = "python " + shlex.join(["bench/trainer_bench.py", *sys.argv[1:]])
    start, opts.load_before = time.perf_counter(), os.getloadavg()[0]
    opts.workdir = tempfile.mkdtemp(prefix="trainer_bench_", dir=opts.workdir)
    print(f"models and logs in {opts.workdir}", flush=True)
    n, rows = {}, {}
    for kind, shape, names in (("train", TRAIN_SHAPE, opts.systems),
                               ("load", LOAD_SHAPE, opts.loads)):
        names = [s for s in names.split(",") if s]
        if not names:
            rows[kind] = []
            continue
        folder = Path(opts.workdir) / f"gpt2_{kind}"
        n[kind] = save_model(shape, folder)
        rows[kind] = [launch(s, folder, shape, opts) for s in names]
    train = train_table(rows["train"]) if rows["train"] else ""
    load = load_table(rows["load"]) if rows["load"] else ""
    print(train, load, sep="\n\n")
    minutes = (time.perf_counter() - start) / 60
    print(f"run time {minutes:.1f} min")
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1) + "\n")
    if opts.page:
        n.setdefault("train", 0), n.setdefault("load", 0)
        opts.page.parent.mkdir(parents=True, exist_ok=True)
        opts.page.write_text(page(opts, train, load, minutes, n))
    return None


if __name__ == "__main__":
    main()
