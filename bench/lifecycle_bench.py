"""Per-rank memory of a training job's life: loading a pretrained folder, the first training
step and saving the model, for ours beside two anchors.

A dense GPT-2 (168M parameters) and a Qwen3-MoE model (~130M) are built from configs (seeded)
and written with ``save_pretrained``; each (model, N, system) is then one
``torch.distributed.run`` of this script's worker mode on N CPU processes (gloo, fp32):

- ``zs_zero3``: ``zero_strategy.transformers.from_pretrained`` (streamed into the shards),
  ``ZeroTrainer(zero_plugin=ZeroPlugin(stage=3))``, ``trainer.save_model``;
- ``ddp``: ``Model.from_pretrained`` and plain ``Trainer`` (accelerate wraps it in DDP);
- ``deepspeed_zero3``: ``Model.from_pretrained`` under ``TrainingArguments(deepspeed=...)``
  (stage 3, ``stage3_gather_16bit_weights_on_model_save: true``), so it loads inside
  ``deepspeed.zero.Init``; ``DS_ACCELERATOR=cpu``.

Each rank measures its resident memory (``/proc/self/status``) around each phase, resetting
the kernel's high-water mark (``VmHWM``, through ``/proc/self/clear_refs``) when a phase
starts: the phase's growth is its peak less the RSS when it began (for loading: less the RSS
after imports and process-group set-up). A system that fails is a row with its error::

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
        python bench/lifecycle_bench.py \\
        --json bench/results/lifecycle-<date>.json [--models dense,moe] [--worlds 2,3]

bench/README.md ("A job's life: load, first step, save") says what every figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from trainer_bench import _last_error, _versions, deepspeed_zero3, run_workers, write_results

SEED = 1234
SYSTEMS = ("zs_zero3", "ddp", "deepspeed_zero3")
EXTRA = ("zs_zero3_whole",)
"""Not run by default: ``Model.from_pretrained`` then ``ZeroTrainer`` at stage 3, ours where
the folder cannot be streamed (the load then holds the whole model, as the anchors do)."""
MODELS = ("dense", "moe")
PHASES = ("load", "step", "save")
SEQ, BATCH = 32, 1  # tokens per row, rows per rank: activations stay small beside the model


# -- the models ---------------------------------------------------------------------------------

def model_class(kind: str) -> Any:
    if kind == "dense":
        from transformers import GPT2LMHeadModel
        return GPT2LMHeadModel
    from transformers import Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM


def model_config(kind: str) -> Any:
    """Dense: the compare.py memory regime's GPT-2 (12 layers, width 1024, vocab 16384: 168M
    parameters, 641 MiB). MoE: Qwen3-MoE with 6 layers of 16 experts (2 per token), width 512,
    vocab 16384, untied: ~130M parameters, most of them experts."""
    if kind == "dense":
        from transformers import GPT2Config
        return GPT2Config(
            n_layer=12, n_embd=1024, n_head=16, vocab_size=16384, n_positions=SEQ,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            tie_word_embeddings=True, bos_token_id=16383, eos_token_id=16383)
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(
        vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16,
        num_experts_per_tok=2, moe_intermediate_size=768, decoder_sparse_step=1,
        max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False,
        output_router_logits=False, bos_token_id=0, eos_token_id=1, pad_token_id=1)


def save_model(kind: str, folder: Path) -> int:
    """The seeded model written with save_pretrained; returns its parameter count."""
    import torch

    torch.manual_seed(SEED)
    model = model_class(kind)(model_config(kind))
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


# -- the parent ---------------------------------------------------------------------------------

def launch(system: str, kind: str, world: int, folder: Path, opts: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"{kind}_n{world}_{system}_", dir=opts.workdir))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(world), __file__, "--worker", system, "--kind", kind,
               "--model", str(folder), "--out", str(out)]
    start = time.perf_counter()
    log, rc, ranks = run_workers(command, out, opts.timeout)
    row: dict[str, Any] = {"system": system, "model": kind, "world": world}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        row["error"] = errors[0]
    elif rc != 0 or len(ranks) != world:
        row["error"] = f"exit {rc}: {_last_error(log)}"
    if ranks and not errors:
        row["ranks"] = ranks
    row["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"{kind} N={world} {system}: {row.get('error', 'ok')} ({row['wall_s']:.0f} s, "
          f"log {out}/log.txt)", flush=True)
    return row


def summarize(row: dict, model_mib: float) -> dict:
    """Each phase's largest growth over ranks, and that growth less 1/N of the model: what a
    rank grows by beyond its share (the issue's bound is on this excess)."""
    if "ranks" not in row:
        return row
    share = model_mib / row["world"]
    for phase in PHASES:
        growth = [r[phase]["growth_mib"] for r in row["ranks"] if phase in r]
        if growth:
            row[f"{phase}_growth_mib"] = [round(g) for g in growth]
            row[f"{phase}_excess_mib"] = round(max(growth) - share)
    row["model_mib"], row["share_mib"] = round(model_mib), round(share)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | N | system | 1/N of model, MiB | load: growth per rank, MiB | "
             "first step | save | largest growth less 1/N: load / step / save "
             "| whole job: peak above the baseline (largest rank) | first loss | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [" / ".join(str(g) for g in r.get(f"{p}_growth_mib", [])) or "-"
                 for p in PHASES]
        excess = " / ".join(str(r.get(f"{p}_excess_mib", "-")) for p in PHASES)
        lines.append(f"| {r['model']} | {r['world']} | `{r['system']}` | {r.get('share_mib', '-')} "
                     f"| {' | '.join(cells)} | {excess} | {_job_peak(r)} | {_loss(r)} "
                     f"| {r.get('error', '')} |")
    return "\n".join(lines)


def _job_peak(row: dict) -> str:
    """The highest RSS any phase reached on a rank, above that rank's baseline: a system
    holding the whole model somewhere shows it here even if it grew at another phase."""
    if "ranks" not in row:
        return "-"
    return str(round(max(max(r[p]["peak_mib"] for p in PHASES if p in r) - r["base_rss_mib"]
                         for r in row["ranks"])))


def _loss(row: dict) -> str:
    """Rank 0's first loss: every system loads the same weights and data, so they agree."""
    loss = row["ranks"][0].get("loss") if "ranks" in row else None
    return "-" if loss is None else f"{loss:.4f}"


def page(result: dict) -> str:
    notes = "".join(f"- Note: {n}\n" for n in result["notes"])
    p = result["params"]
    return f"""# A job's life: load, first step, save ({result['date'][:10]})

Per-rank peak memory growth of each phase of a Trainer job (`bench/lifecycle_bench.py`; what
every figure means: `bench/README.md`, "A job's life").

- Command: `{result['command']}`
- Date: {result['date']}. Machine: the 2-core development machine, N processes with one
  thread each (`OMP_NUM_THREADS=1`), gloo, fp32, CPU; **shared with other jobs while it ran**
  (1-minute load average {result['load_average'][0]} at the start,
  {result['load_average'][1]} at the end): memory figures are the point, wall times are not
  reported. {result['versions']}.
- Run time: {result['minutes']} min.
{notes}
Models: dense GPT-2 (12 layers, width 1024, vocab 16384, tied: {p.get('dense', 0) / 1e6:.0f}M
parameters, {p.get('dense', 0) * 4 / 2**20:.0f} MiB); MoE Qwen3-MoE (6 layers of 16 experts,
2 per token, width 512, vocab 16384: {p.get('moe', 0) / 1e6:.0f}M parameters,
{p.get('moe', 0) * 4 / 2**20:.0f} MiB). Both saved with `save_pretrained`, then trained one
step (AdamW, {result['batch_per_rank']} row of {result['seq']} tokens per rank) and saved
with `trainer.save_model`.

Growth per rank (rank 0 first), MiB: load is the peak from the end of imports and process-group
set-up to Trainer's `on_train_begin` (model loaded, wrapped, optimizer built); the first step
the peak of step 1 above the RSS it began with (gradients and the optimizer's states appear
here); save the peak of `save_model` above the RSS it began with.

{table(result['rows'])}
"""


# -- the worker ---------------------------------------------------------------------------------

def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":")) / 1024


class Phases:
    """Each phase's peak (VmHWM since the phase began) and RSS at its start and end."""

    def __init__(self) -> None:
        self.record: dict[str, Any] = {}
        self._start = self.base = _status_mib("VmRSS")
        self._reset()

    @staticmethod
    def _reset() -> None:
        # "5" resets the peak resident set size (VmHWM) to the current RSS (proc(5)).
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def begin(self) -> None:
        self._start = _status_mib("VmRSS")
        self._reset()

    def end(self, phase: str, since_base: bool = False) -> None:
        peak, now = _status_mib("VmHWM"), _status_mib("VmRSS")
        start = self.base if since_base else self._start
        self.record[phase] = {"growth_mib": peak - start, "start_mib": start - self.base,
                              "held_mib": now - self.base, "peak_mib": peak}
        self.begin()


def phase_callback(phases: Phases) -> Any:
    """Loading ends when Trainer begins training (the model is wrapped and the optimizer
    built, DeepSpeed's engine included); the first step ends at the first on_step_end."""
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            phases.end("load", since_base=True)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if "step" not in phases.record:
                phases.end("step")

    return Marks()


def token_rows(vocab: int, rows: int) -> Any:
    import torch
    from torch.utils.data import Dataset

    class Tokens(Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(SEED)
            self.ids = torch.randint(0, vocab, (rows, SEQ), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    return Tokens()


def arguments(system: str, out: Path) -> Any:
    from transformers import TrainingArguments

    extra: dict[str, Any] = {}
    if system == "deepspeed_zero3":
        extra["deepspeed"] = deepspeed_zero3(stage3_gather_16bit_weights_on_model_save=True)
    return TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=1, learning_rate=1e-4,
        max_grad_norm=1.0, optim="adamw_torch", report_to=[], save_strategy="no", seed=SEED,
        use_cpu=True, ddp_backend="gloo", disable_tqdm=True, logging_steps=1, **extra)


def load(system: str, kind: str, folder: Path) -> Any:
    cls = model_class(kind)
    if system == "zs_zero3":
        from zero_strategy.transformers import from_pretrained
        return from_pretrained(cls, folder).train()
    # Under deepspeed_zero3 the TrainingArguments built before make this load inside
    # deepspeed.zero.Init (partitioned as it loads): DeepSpeed's own streamed loading.
    return cls.from_pretrained(folder).train()


def worker(system: str, kind: str, folder: Path, out: Path) -> dict:
    import torch.distributed as dist
    import transformers
    from transformers import Trainer

    transformers.logging.set_verbosity_error()
    model_class(kind)
    if system == "deepspeed_zero3":
        import deepspeed  # noqa: F401
    else:
        import zero_strategy.transformers  # noqa: F401
    args = arguments(system, out / "trainer")
    args.device  # noqa: B018  (the process group, before the baseline)
    phases = Phases()
    model = load(system, kind, folder)
    kwargs = {"model": model, "args": args, "callbacks": [phase_callback(phases)],
              "train_dataset": token_rows(model.config.vocab_size, args.world_size * BATCH)}
    if system.startswith("zs_zero3"):
        from zero_strategy.transformers import ZeroPlugin, ZeroTrainer
        trainer = ZeroTrainer(zero_plugin=ZeroPlugin(stage=3), **kwargs)
    else:
        trainer = Trainer(**kwargs)
    trainer.train()
    dist.barrier()
    phases.begin()
    trainer.save_model(str(out / "saved"))
    dist.barrier()
    phases.end("save")
    saved = sum(f.stat().st_size for f in (out / "saved").glob("*.safetensors"))
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {**phases.record, "base_rss_mib": phases.base, "saved_mib": saved / 2**20,
            "loss": loss[0] if loss else None}


# -- main ---------------------------------------------------------------------------------------

def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--worlds", default="2,3")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"of {', '.join(SYSTEMS + EXTRA)}")
    p.add_argument("--timeout", type=int, default=400, help="seconds per launch")
    p.add_argument("--workdir", default=None, help="where models and logs go (a temp folder)")
    p.add_argument("--json", type=Path, help="write every row as JSON")
    p.add_argument("--page", type=Path, help="write the table as this markdown page")
    p.add_argument("--from-json", type=Path, help="only write --page from this --json file")
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


def run_worker(opts: argparse.Namespace) -> None:
    try:
        record = worker(opts.worker, opts.kind, opts.model, opts.out)
    except Exception as e:  # recorded, so the table says why a system did not run
        traceback.print_exc()
        record = {"error": f"{type(e).__name__}: {e}".replace("\n", " ")[:400]}
    (opts.out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))


def main() -> None:
    opts = parse()
    if opts.worker:
        return run_worker(opts)
    if opts.from_json:
        return write(opts, json.loads(opts.from_json.read_text()))
    command = "python " + shlex.join(["bench/lifecycle_bench.py", *sys.argv[1:]])
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    opts.workdir = tempfile.mkdtemp(prefix="lifecycle_bench_", dir=opts.workdir)
    print(f"models and logs in {opts.workdir}", flush=True)
    rows, params = [], {}
    for kind in [k for k in opts.models.split(",") if k]:
        folder = Path(opts.workdir) / kind
        params[kind] = save_model(kind, folder)
        for world in [int(n) for n in opts.worlds.split(",")]:
            for system in [s for s in opts.systems.split(",") if s]:
                row = launch(system, kind, world, folder, opts)
                rows.append(summarize(row, params[kind] * 4 / 2**20))
    print(table(rows))
    minutes = (time.perf_counter() - start) / 60
    print(f"run time {minutes:.1f} min")
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
              "versions": _versions(), "params": params, "minutes": round(minutes, 1),
              "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
              "notes": opts.note, "seq": SEQ, "batch_per_rank": BATCH, "rows": rows}
    write(opts, result)
    return None


def write(opts: argparse.Namespace, result: dict) -> None:
    write_results(opts.json, opts.page, result, page)


if __name__ == "__main__":
    main()
