"""Per-rank memory of a training job's life: loading a pretrained folder, the first steps
(forward, backward, optimizer step) and saving the model, for ours beside two anchors and for
the freezing patterns users choose, with the bound ``engine.phase_bounds()`` states for ours.

A dense GPT-2 (168M parameters) and a Qwen3-MoE model (~135M) are built from configs (seeded)
and written with ``save_pretrained``; each (model, N, system, pattern) is then one
``torch.distributed.run`` of this script's worker mode on N CPU processes (gloo, fp32):

- ``zs_zero3``: ``zero_strategy.transformers.from_pretrained`` (streamed into the shards),
  ``ZeroTrainer(zero_plugin=ZeroPlugin(stage=3))``, ``trainer.save_model``;
- ``ddp``: ``Model.from_pretrained`` and plain ``Trainer`` (accelerate wraps it in DDP);
- ``deepspeed_zero3``: ``Model.from_pretrained`` under ``TrainingArguments(deepspeed=...)``
  (stage 3, ``stage3_gather_16bit_weights_on_model_save: true``), so it loads inside
  ``deepspeed.zero.Init``; ``DS_ACCELERATOR=cpu``.

Patterns (``bench/phase_memory.py``, where they are defined for both families): ``full``;
``head`` (the final norm, and the MoE's untied ``lm_head``); ``first_block`` (backward
crosses every frozen block); ``lora_all`` (PEFT LoRA r=8 on every block's attention; ours
streamed too, the anchors loaded whole). Ours runs every pattern given; the anchors those of
``--anchor-patterns``.

Each rank measures its resident memory (``/proc/self/status``) around each phase, resetting
the kernel's high-water mark (``VmHWM``, through ``/proc/self/clear_refs``) when a phase
starts: a phase's growth is its peak less the RSS when it began (for loading: less the RSS
after imports and process-group set-up), the largest over the steps. A system that fails is
a row with its error::

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
        python bench/lifecycle_bench.py --json bench/results/lifecycle-<date>.json \\
        --page docs/performance/lifecycle-<date>.md [--models dense,moe] [--worlds 2,3]

bench/README.md ("A job's life") says what every figure means.
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

import phase_memory as pm
from trainer_bench import _last_error, _versions, deepspeed_zero3, run_workers, write_results

SEED = 1234
SYSTEMS = ("zs_zero3", "ddp", "deepspeed_zero3")
EXTRA = ("zs_zero3_whole",)
"""Not run by default: ``Model.from_pretrained`` then ``ZeroTrainer`` at stage 3, ours where
the folder cannot be streamed (the load then holds the whole model, as the anchors do)."""
MODELS = ("dense", "moe")
PATTERNS = ("full", "head", "first_block", "lora_all")
PHASES = pm.PHASES
SEQ, BATCH, STEPS = 32, 1, 2  # tokens per row, rows per rank, steps: activations stay small


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

def launch(system: str, kind: str, world: int, pattern: str, folder: Path,
           opts: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"{kind}_n{world}_{system}_{pattern}_", dir=opts.workdir))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(world), __file__, "--worker", system, "--kind", kind,
               "--pattern", pattern, "--model", str(folder), "--out", str(out)]
    start = time.perf_counter()
    log, rc, ranks = run_workers(command, out, opts.timeout)
    row: dict[str, Any] = {"system": system, "model": kind, "world": world, "pattern": pattern}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        row["error"] = errors[0]
    elif rc != 0 or len(ranks) != world:
        row["error"] = f"exit {rc}: {_last_error(log)}"
    if ranks and not errors:
        row["ranks"] = ranks
    row["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"{kind} N={world} {system} {pattern}: {row.get('error', 'ok')} "
          f"({row['wall_s']:.0f} s, log {out}/log.txt)", flush=True)
    return row


def summarize(row: dict, model_mib: float) -> dict:
    """Each phase's largest growth over ranks, beside the largest bound (ours)."""
    if "ranks" not in row:
        return row
    for phase in PHASES:
        row[f"{phase}_growth_mib"] = round(max(r["growth"][phase] for r in row["ranks"]))
        bounds = [r["bound"][phase] for r in row["ranks"] if r.get("bound")]
        if bounds:
            row[f"{phase}_bound_mib"] = round(max(bounds))
    row["over"] = [p for p in PHASES if row.get(f"{p}_bound_mib") is not None
                   and row[f"{p}_growth_mib"] > row[f"{p}_bound_mib"]]
    row["model_mib"], row["share_mib"] = round(model_mib), round(model_mib / row["world"])
    row["trainable_mib"] = round(row["ranks"][0]["trainable"] * 4 / 2**20)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | N | system | pattern | trains, MiB | load | forward | backward | step "
             "| save | whole job: peak above the baseline | first loss | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [_cell(r, p) for p in PHASES]
        lines.append(f"| {r['model']} | {r['world']} | `{r['system']}` | {r['pattern']} "
                     f"| {r.get('trainable_mib', '-')} | {' | '.join(cells)} | {_job_peak(r)} "
                     f"| {_loss(r)} | {r.get('error', '')} |")
    return "\n".join(lines)


def _cell(row: dict, phase: str) -> str:
    """The largest growth over ranks, and for ours "/ bound" (bold where over it)."""
    growth = row.get(f"{phase}_growth_mib")
    if growth is None:
        return "-"
    bound = row.get(f"{phase}_bound_mib")
    if bound is None:
        return str(growth)
    return f"**{growth} / {bound}**" if growth > bound else f"{growth} / {bound}"


def _job_peak(row: dict) -> str:
    """The highest RSS any phase reached on a rank, above that rank's baseline: a system
    holding the whole model somewhere shows it here even if it grew at another phase."""
    if "ranks" not in row:
        return "-"
    return str(round(max(r["job_peak_mib"] for r in row["ranks"])))


def _loss(row: dict) -> str:
    """Rank 0's first loss: every system loads the same weights and data, so they agree."""
    loss = row["ranks"][0].get("loss") if "ranks" in row else None
    return "-" if loss is None else f"{loss:.4f}"


def page(result: dict) -> str:
    notes = "".join(f"- Note: {n}\n" for n in result["notes"])
    p = result["params"]
    load = result["load_average"]
    return f"""# A job's life: load, first steps, save, by freezing pattern ({result['date'][:10]})

Per-rank peak memory growth of each phase of a Trainer job, with the bound
`engine.phase_bounds()` states for ours (`bench/lifecycle_bench.py`; what every figure means:
`bench/README.md`, "A job's life").

- Command: `{result['command']}`
- Date: {result['date']}. Machine: the 2-core development machine, N processes with one
  thread each (`OMP_NUM_THREADS=1`), gloo, fp32, CPU, `MALLOC_MMAP_THRESHOLD_=65536` (freed
  buffers of 64 KiB and more go back to the system at once, so each phase's growth is its
  own). 1-minute load average {load[0]} at the start, {load[1]} at the end (other jobs
  shared the machine): memory figures are the point, wall times are not reported.
  {result['versions']}.
- Run time: {result['minutes']} min.
{notes}
Models: dense GPT-2 (12 layers, width 1024, vocab 16384, tied: {p.get('dense', 0) / 1e6:.0f}M
parameters, {p.get('dense', 0) * 4 / 2**20:.0f} MiB); MoE Qwen3-MoE (6 layers of 16 fused
experts, 2 per token, width 512, vocab 16384, untied: {p.get('moe', 0) / 1e6:.0f}M parameters,
{p.get('moe', 0) * 4 / 2**20:.0f} MiB). Both saved with `save_pretrained`, then trained
{result['steps']} steps (AdamW, {result['batch_per_rank']} row of {result['seq']} tokens per
rank, clipping at 1.0) and saved with `trainer.save_model`.

Largest growth over ranks, MiB; for ours "growth / bound" (**bold** where over): load from
the end of imports and process-group set-up to Trainer's `on_train_begin` (model loaded,
wrapped, optimizer built); forward (`compute_loss`), backward (`accelerator.backward`; under
DeepSpeed this includes its optimizer step, which Accelerate runs there) and step (from there
to `on_step_end`: clipping, the optimizer, the schedule), each the largest over the steps;
save the streamed `save_model`. "trains": the trainable parameters' fp32 bytes.

{table(result['rows'])}
"""


# -- the worker ---------------------------------------------------------------------------------

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
        output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS,
        learning_rate=1e-4, max_grad_norm=1.0, optim="adamw_torch", report_to=[],
        save_strategy="no", seed=SEED, use_cpu=True, ddp_backend="gloo", disable_tqdm=True,
        logging_steps=1, **extra)


def activations(kind: str, model: Any, engine: Any) -> int:
    """The activations term: the formula for GPT-2; for the MoE (no formula covers it) what
    the engine measured of the first training forward, plus the logits' gradient."""
    if kind == "dense":
        from zero_strategy import estimate_activations
        return estimate_activations(model.config, batch_size=BATCH, seq_len=SEQ).peak_bytes
    saved = engine.memory_report()["activation_bytes"] or 0
    return saved + 2 * BATCH * SEQ * model.config.vocab_size * 4


def worker(system: str, kind: str, pattern: str, folder: Path, out: Path) -> dict:
    import torch.distributed as dist
    import transformers
    from transformers import Trainer

    transformers.logging.set_verbosity_error()
    cls = model_class(kind)
    if system == "deepspeed_zero3":
        import deepspeed  # noqa: F401
    import peft  # noqa: F401

    import zero_strategy.transformers  # noqa: F401
    args = arguments(system, out / "trainer")
    args.device  # noqa: B018  (the process group, before the baseline)
    run = pm.Run(pattern)
    run.meter.start(collect=True)
    base = run.meter.at
    # Under deepspeed_zero3 the TrainingArguments built before make this load inside
    # deepspeed.zero.Init (partitioned as it loads): DeepSpeed's own streamed loading.
    model = pm.load_model(pattern, folder, cls=cls, streamed=system == "zs_zero3")
    kwargs = {"model": model, "args": args,
              "train_dataset": token_rows(model.config.vocab_size, args.world_size * BATCH * STEPS)}
    if system.startswith("zs_zero3"):
        from zero_strategy.transformers import ZeroPlugin, ZeroTrainer
        trainer = ZeroTrainer(zero_plugin=ZeroPlugin(stage=3), **kwargs)
    else:
        trainer = Trainer(**kwargs)
    pm.watch(run, trainer)
    trainer.train()
    if system.startswith("zs_zero3"):
        engine = trainer.zero_engine
        run.bound(engine, activations(kind, model, engine),
                  loaded_whole=system == "zs_zero3_whole")
    dist.barrier()
    run.meter.start(collect=True)
    trainer.save_model(str(out / "saved"))
    dist.barrier()
    run.meter.stop("save")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {**run.record(), "job_peak_mib": round(run.meter.peak - base, 1),
            "trainable": trainable, "loss": run.losses[0] if run.losses else None}


# -- main ---------------------------------------------------------------------------------------

def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--worlds", default="2,3")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"of {', '.join(SYSTEMS + EXTRA)}")
    p.add_argument("--patterns", default=",".join(PATTERNS),
                   help="freezing patterns of ours (bench/phase_memory.py names them)")
    p.add_argument("--anchor-patterns", default="full",
                   help="freezing patterns of ddp and deepspeed_zero3")
    p.add_argument("--timeout", type=int, default=400, help="seconds per launch")
    p.add_argument("--workdir", default=None, help="where models and logs go (a temp folder)")
    p.add_argument("--json", type=Path, help="write every row as JSON")
    p.add_argument("--page", type=Path, help="write the table as this markdown page")
    p.add_argument("--from-json", type=Path, help="only write --page from this --json file")
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--pattern", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


def run_worker(opts: argparse.Namespace) -> None:
    try:
        record = worker(opts.worker, opts.kind, opts.pattern, opts.model, opts.out)
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
                patterns = opts.patterns if system.startswith("zs") else opts.anchor_patterns
                for pattern in [q for q in patterns.split(",") if q]:
                    row = launch(system, kind, world, pattern, folder, opts)
                    rows.append(summarize(row, params[kind] * 4 / 2**20))
    print(table(rows))
    minutes = (time.perf_counter() - start) / 60
    print(f"run time {minutes:.1f} min")
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
              "versions": _versions(), "params": params, "minutes": round(minutes, 1),
              "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
              "notes": opts.note, "seq": SEQ, "batch_per_rank": BATCH, "steps": STEPS,
              "rows": rows}
    write(opts, result)
    return None


def write(opts: argparse.Namespace, result: dict) -> None:
    write_results(opts.json, opts.page, result, page)


if __name__ == "__main__":
    main()
