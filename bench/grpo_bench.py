"""Seconds per GRPO step, split into generation and training, and peak memory per rank: TRL's
``GRPOTrainer`` under ``with_zero`` at stage 3, under DDP, and with DeepSpeed ZeRO-3.

A GPT-2 of ~104M parameters (12 layers, width 768, vocab 24576; fp32, random weights from a
seeded config) learns from a Python reward function on prompts of random words, with a
word-level tokenizer built in code (no download). Every step generates 4 completions of 32
tokens for each of 2 prompts (2 per rank at N=2: ``per_device_train_batch_size=4``,
``num_generations=4``, ``min_new_tokens`` = ``max_completion_length`` = 32), then trains on
them. Each system is one ``torch.distributed.run`` of this script's worker mode; the
systems alternate for ``--rounds`` rounds, so a slow spell of the shared machine falls on each::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python bench/grpo_bench.py \\
        --json bench/results/grpo-<date>.json

bench/README.md ("GRPO steps") says what every figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from trainer_bench import _last_error, _versions, deepspeed_zero3, run_workers, write_results

SEED = 1234
SYSTEMS = ("zs_zero3", "ddp", "deepspeed_zero3")
VOCAB, WIDTH, LAYERS, HEADS = 24576, 768, 12, 12
COMPLETION, PROMPT_WORDS = 32, 8
BATCH, GENERATIONS = 4, 4  # completions per rank per step; completions per prompt


# -- the parent ---------------------------------------------------------------------------------

def launch(system: str, round_: int, opts: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"grpo_{system}_{round_}_", dir=opts.workdir))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(opts.nproc), __file__, "--worker", system,
               "--out", str(out), "--warmup", str(opts.warmup), "--steps", str(opts.steps)]
    start = time.perf_counter()
    log, rc, ranks = run_workers(command, out, opts.timeout)
    row: dict[str, Any] = {"system": system, "round": round_}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        row["error"] = errors[0]
    elif rc != 0 or len(ranks) != opts.nproc:
        row["error"] = f"exit {rc}: {_last_error(log)}"
    else:
        row.update(combine(ranks, opts.warmup))
    row["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"round {round_} {system}: {row.get('error', 'ok')} ({row['wall_s']:.0f} s, "
          f"log {out}/log.txt)", flush=True)
    return row


def combine(ranks: list[dict], warmup: int) -> dict:
    """A step lasts as long as its slowest rank; its generation is the slowest rank's
    generation in it, the rest is training (loss, backward, optimizer step, rewards)."""
    steps = len(ranks[0]["step_s"])
    step = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    gen = [max(r["generate_s"][i] for r in ranks) for i in range(steps)]
    timed = range(warmup, steps)
    return {"step_s": [round(s, 3) for s in step], "generate_s": [round(g, 3) for g in gen],
            "median_step_s": statistics.median(step[i] for i in timed),
            "median_generate_s": statistics.median(gen[i] for i in timed),
            "median_train_s": statistics.median(step[i] - gen[i] for i in timed),
            "peak_rss_growth_mib": [round(r["growth_mib"]) for r in ranks],
            "peak_rss_mib": [round(r["peak_rss_mib"]) for r in ranks],
            "completion_tokens": ranks[0]["completion_tokens"], "losses": ranks[0]["losses"]}


def summary(rows: list[dict]) -> list[dict]:
    """Per system: the round with the smallest median step (the least disturbed by the
    machine's other jobs), every round's median beside it, and x DDP: the median over rounds
    of the system's step over DDP's in the same round."""
    out = []
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        ok = [r for r in mine if "error" not in r]
        if not ok:
            out.append({"system": system, "error": mine[0].get("error", "")})
            continue
        best = min(ok, key=lambda r: r["median_step_s"])
        out.append({"system": system, "rounds_median_step_s": [round(r["median_step_s"], 2)
                                                                for r in ok],
                    **{k: best[k] for k in ("median_step_s", "median_generate_s",
                                            "median_train_s", "completion_tokens")},
                    "peak_rss_growth_mib": max(max(r["peak_rss_growth_mib"]) for r in ok),
                    "peak_rss_mib": max(max(r["peak_rss_mib"]) for r in ok)})
    for s in out:
        ratios = paired_ratios(rows, s["system"])
        if ratios:
            s["x_ddp_per_round"] = ratios
            s["x_ddp"] = round(statistics.median(ratios), 2)
            for part in ("generate", "train"):
                s[f"{part}_x_ddp"] = round(statistics.median(
                    paired_ratios(rows, s["system"], f"median_{part}_s")), 2)
    return out


def paired_ratios(rows: list[dict], system: str, key: str = "median_step_s") -> list[float]:
    """The system's median step (or part of it) over DDP's in the same round: the two ran one
    after the other, so a slow spell of the machine that lasts a round weighs on both."""
    step = {(r["system"], r["round"]): r[key] for r in rows if "error" not in r}
    return [round(step[(system, n)] / step[("ddp", n)], 2)
            for n in sorted({r["round"] for r in rows})
            if (system, n) in step and ("ddp", n) in step]


def _ratio(s: dict) -> str:
    per_round = " / ".join(f"{v:.2f}" for v in s.get("x_ddp_per_round", []))
    return f"{s['x_ddp']:.2f} ({per_round})" if "x_ddp" in s else "-"


def table(summ: list[dict]) -> str:
    lines = ["| system | s/step (median) | generation (x DDP) | training (x DDP) "
             "| x DDP (per round) "
             "| s/step per round "
             "| peak RSS growth per rank, MiB (max) | completion tokens | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summ:
        if "error" in s:
            lines.append(f"| `{s['system']}` | - | - | - | - | - | - | - | {s['error']} |")
            continue
        rounds = " / ".join(f"{v:.2f}" for v in s["rounds_median_step_s"])
        lines.append(f"| `{s['system']}` | {s['median_step_s']:.2f} | "
                     f"{s['median_generate_s']:.2f} (x{s.get('generate_x_ddp', '-')}) | "
                     f"{s['median_train_s']:.2f} (x{s.get('train_x_ddp', '-')}) | "
                     f"{_ratio(s)} | {rounds} | {s['peak_rss_growth_mib']} | "
                     f"{s['completion_tokens']} | |")
    return "\n".join(lines)


# -- the worker ---------------------------------------------------------------------------------

WORDS = [f"w{i}" for i in range(VOCAB - 3)]


def tokenizer() -> Any:
    """A word-level tokenizer built in code: no download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def prompts(rows: int) -> Any:
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, len(WORDS), (rows, PROMPT_WORDS), generator=g).tolist()
    return Dataset.from_dict({"prompt": [" ".join(WORDS[i] for i in r) for r in ids]})


def even_words(completions: list[str], **kwargs: Any) -> list[float]:
    """The reward: the share of a completion's words with an even index (it varies between
    a prompt's completions, so advantages are not zero and every step has a gradient)."""
    return [sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in c.split()) / COMPLETION
            for c in completions]


def build_model() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    return GPT2LMHeadModel(GPT2Config(
        n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=128,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=1, pad_token_id=0))


def config(system: str, out: Path, steps: int) -> Any:
    from trl import GRPOConfig

    extra: dict[str, Any] = {}
    if system == "deepspeed_zero3":
        extra["deepspeed"] = deepspeed_zero3()
    return GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=BATCH, num_generations=GENERATIONS,
        max_completion_length=COMPLETION, generation_kwargs={"min_new_tokens": COMPLETION},
        max_steps=steps, learning_rate=1e-6, max_grad_norm=1.0, bf16=False, use_cpu=True,
        ddp_backend="gloo", report_to=[], save_strategy="no", logging_steps=1, seed=SEED,
        disable_tqdm=True, **extra)


class Timings:
    """Each step's seconds (on_step_begin to on_step_end) and the seconds spent generating in
    it (GRPOTrainer._generate_single_turn: unwrapping or gathering the model, generate())."""

    def __init__(self) -> None:
        self.step: list[float] = []
        self.generate: list[float] = []
        self._gen = 0.0
        self._start = 0.0

    def callback(self) -> Any:
        from transformers import TrainerCallback

        timings = self

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                timings._start, timings._gen = time.perf_counter(), 0.0

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                timings.step.append(time.perf_counter() - timings._start)
                timings.generate.append(timings._gen)

        return StepTimer()

    def wrap(self, trainer: Any) -> None:
        inner = trainer._generate_single_turn

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._gen += time.perf_counter() - start

        trainer._generate_single_turn = timed


def worker(system: str, out: Path, steps: int) -> dict:
    import transformers
    from trl import GRPOTrainer

    transformers.logging.set_verbosity_error()
    if system == "deepspeed_zero3":
        import deepspeed  # noqa: F401
    else:
        from zero_strategy.transformers import ZeroPlugin, with_zero
    args = config(system, out / "trainer", steps)
    args.device  # noqa: B018  (the process group, before the baseline)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    timings = Timings()
    model = build_model()
    params = sum(p.numel() for p in model.parameters())
    kwargs = {"model": model, "reward_funcs": even_words, "args": args,
              "train_dataset": prompts(steps * args.world_size * BATCH // GENERATIONS),
              "processing_class": tokenizer(), "callbacks": [timings.callback()]}
    if system == "zs_zero3":
        trainer = with_zero(GRPOTrainer)(zero_plugin=ZeroPlugin(stage=3), **kwargs)
    else:
        trainer = GRPOTrainer(**kwargs)
    timings.wrap(trainer)
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"step_s": timings.step, "generate_s": timings.generate, "peak_rss_mib": peak,
            "params": params,
            "growth_mib": peak - base, "losses": [h["loss"] for h in logs],
            "completion_tokens": [h.get("completions/mean_length") for h in logs]}


# -- main ---------------------------------------------------------------------------------------

def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rounds", type=int, default=2, help="runs of every system, alternating")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=int, default=400, help="seconds per launch")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", type=Path, help="write every run and the summary as JSON")
    p.add_argument("--page", type=Path, help="write the table as this markdown page")
    p.add_argument("--from-json", type=Path, help="only write --page from this --json file")
    p.add_argument("--combine", type=Path, nargs="+",
                   help="only combine these --json files (their rounds) into --json / --page")
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    opts = parse()
    if opts.worker:
        try:
            record = worker(opts.worker, opts.out, opts.warmup + opts.steps)
        except Exception as e:  # recorded, so the table says why a system did not run
            traceback.print_exc()
            record = {"error": f"{type(e).__name__}: {e}".replace("\n", " ")[:400]}
        (opts.out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
        return
    if opts.from_json:
        return write(opts, json.loads(opts.from_json.read_text()))
    if opts.combine:
        return write(opts, combine_runs([json.loads(p.read_text()) for p in opts.combine]))
    command = "python " + shlex.join(["bench/grpo_bench.py", *sys.argv[1:]])
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    opts.workdir = tempfile.mkdtemp(prefix="grpo_bench_", dir=opts.workdir)
    print(f"logs in {opts.workdir}", flush=True)
    systems = [s for s in opts.systems.split(",") if s]
    rows = [launch(s, r, opts) for r in range(opts.rounds) for s in systems]
    summ = summary(rows)
    print(table(summ))
    minutes = (time.perf_counter() - start) / 60
    print(f"run time {minutes:.1f} min")
    write(opts, {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "command": command, "versions": _versions(), "minutes": round(minutes, 1),
                 "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
                 "notes": opts.note, "nproc": opts.nproc, "warmup": opts.warmup,
                 "steps": opts.steps, "summary": summ, "rows": rows})


def combine_runs(runs: list[dict]) -> dict:
    """Several runs as one: their rounds numbered on, in the order given, the summary made
    again over all of them (more rounds of the same systems on the same machine)."""
    rows, offset = [], 0
    for run in runs:
        rows += [{**r, "round": r["round"] + offset} for r in run["rows"]]
        offset += max(r["round"] for r in run["rows"]) + 1
    first, last = runs[0], runs[-1]
    return {**first, "date": last["date"], "command": " && ".join(r["command"] for r in runs),
            "minutes": round(sum(r["minutes"] for r in runs), 1),
            "load_average": [first["load_average"][0], last["load_average"][1]],
            "notes": [n for r in runs for n in r["notes"]], "summary": summary(rows),
            "rows": rows}


def write(opts: argparse.Namespace, result: dict) -> None:
    write_results(opts.json, opts.page, result, page)


def page(result: dict) -> str:
    notes = "".join(f"- Note: {n}\n" for n in result["notes"])
    rounds = max(r["round"] for r in result["rows"]) + 1
    ds_rounds = sum(r["system"] == "deepspeed_zero3" for r in result["rows"])
    return f"""# GRPO steps, {result['date'][:10]}

TRL's `GRPOTrainer` three ways (`bench/grpo_bench.py`; what every figure means:
`bench/README.md`, "GRPO steps").

- Command: `{result['command']}`
- Date: {result['date']}. Machine: the 2-core development machine, {result['nproc']}
  processes with one thread each (`OMP_NUM_THREADS=1`), gloo, fp32, CPU; 1-minute load
  average {result['load_average'][0]} at the start and {result['load_average'][1]} at the end
  (the job itself adds about 2; more means other jobs shared the 2 cores and step times are
  noisier): the systems alternated
  for {rounds} rounds (DeepSpeed in the first {ds_rounds}); each row's times are its least
  disturbed round, x DDP the median over rounds of its step over DDP's in the same round.
  {result['versions']}.
- Run time: {result['minutes']} min.
{notes}
GPT-2 from a config (12 layers, width 768, vocab 24576: 104M parameters, fp32, `bf16=False`),
a word-level tokenizer built in code, prompts of {PROMPT_WORDS} random words, a Python reward
(the share of words with an even index); per step and rank {BATCH} completions of
{COMPLETION} tokens (`num_generations={GENERATIONS}`, `min_new_tokens` =
`max_completion_length` = {COMPLETION}); TRL's defaults otherwise (gradient checkpointing on,
`beta=0`: no reference model). {result['warmup']} warm-up step(s), then the median of
{result['steps']} timed steps (slowest rank); generation is the time inside
`GRPOTrainer._generate_single_turn` (unwrapping or gathering the model and `generate()`),
training the rest of the step.

{table(result['summary'])}
"""


if __name__ == "__main__":
    main()
