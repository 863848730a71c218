"""Per-rank memory of each phase of a stage-3 training job (load, forward, backward, step,
save) beside the bound ``engine.phase_bounds()`` gives, on every entry point a user trains
through, for every freezing pattern users choose.

One launch per entry point (``--path``) runs its patterns one after another on the same
process group, each with fresh objects (model, engine, trainer): a pattern's figures are
growth over its own baseline, so what an earlier pattern left in the heap does not count.
The model is a GPT-2 of 8 layers, width 768, vocab 8192 (63M parameters, 241 MiB fp32) saved
with ``save_pretrained`` (``--make-folder``), so a whole copy (241 MiB) cannot hide in a
bound's slack (24 MiB). Each rank trains 2 steps on one row of 32 tokens (AdamW, clipping at
1.0, fp32, gloo), then saves the model streamed.

Paths: ``engine`` (``ZeroEngine`` by hand), ``fabric`` and ``lightning`` (``strategy="zero3"``),
``accelerator`` (``ZeroAccelerator.prepare``), ``trainer`` (``ZeroTrainer``), ``sft``
(``with_zero(SFTTrainer)``, TRL's default activation checkpointing on) and ``reference``
(``with_zero(DPOTrainer)`` with a frozen reference model beside the policy, both streamed:
TRL prepares the reference with ``evaluation_mode=True``, a frozen engine of its own).
Patterns: ``full``; ``head`` (``transformer.ln_f``: nothing before it trains, Trainer's
decay group is empty); ``last_blocks`` (the last 2 blocks and ``ln_f``); ``first_block``
(``transformer.h.0``: backward crosses every frozen block); ``lora_all`` and ``lora_some``
(PEFT LoRA r=8 on ``c_attn`` and ``c_proj`` of every block, or of the first and the last);
``reference`` (the ``reference`` path's: a full fine-tune beside a frozen reference).

Models load streamed (``zero_strategy.transformers.from_pretrained``), LoRA too: PEFT wraps
the model on meta, and the engine reads the base weights under PEFT's names and gives the
adapters PEFT's init (``integrations/hf/peft_init.py``).

Phase boundaries: load from the pattern's start to the engine built (Trainer's
``on_train_begin``, Lightning's ``on_train_start``); forward the model call (Trainer's
``compute_loss``); backward the backward call; step the rest of the step (clipping,
``optimizer.step``, ``zero_grad``, schedulers, callbacks); save the streamed save. Each
phase's growth is the peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``
when the phase begins) above the RSS when it began, the largest over the 2 steps::

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
        python bench/phase_memory.py --make-folder /tmp/gpt2-241m
    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
        python -m torch.distributed.run --standalone --nproc_per_node 2 bench/phase_memory.py \\
        --path trainer --folder /tmp/gpt2-241m --out OUT [--patterns head,full]

Each rank writes ``OUT/rank<r>.json``: per pattern, each phase's growth and bound (MiB), the
bound's terms and the losses. ``tests/integration/test_phase_memory.py`` runs every path.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from grpo_bench import WORDS, tokenizer  # a word-level tokenizer built in code

PATHS = ("engine", "fabric", "lightning", "accelerator", "trainer", "sft", "reference")
PATTERNS = ("full", "head", "last_blocks", "first_block", "lora_all", "lora_some")
PHASES = ("load", "forward", "backward", "step", "save")
LAYERS, WIDTH, VOCAB, SEQ, BATCH, STEPS, LR = 8, 768, 8192, 32, 1, 2, 1e-4
MIB = 2**20


# -- the model and the patterns -------------------------------------------------------------

def make_folder(folder: Path) -> int:
    """The seeded GPT-2 written with save_pretrained; its parameter count."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    config = GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=12, vocab_size=VOCAB,
                        n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


# Per model family: the blocks' prefix, the final norm's, an untied head's, and LoRA's targets.
FAMILY = {"gpt2": ("transformer.h.", ("transformer.ln_f.",), ["c_attn", "c_proj"]),
          "qwen3_moe": ("model.layers.", ("model.norm.", "lm_head."),
                        ["q_proj", "k_proj", "v_proj", "o_proj"])}


def trained_prefixes(pattern: str, config: Any = None) -> tuple[str, ...] | None:
    """Parameter name prefixes that train under ``pattern`` (None: all of them), for a model
    of ``config`` (default: the GPT-2 of ``make_folder``)."""
    kind, layers = (config.model_type, config.num_hidden_layers) if config else ("gpt2", LAYERS)
    blocks, head, _ = FAMILY[kind]
    return {"full": None, "reference": None, "head": head,
            "last_blocks": (f"{blocks}{layers - 2}.", f"{blocks}{layers - 1}.", *head),
            "first_block": (f"{blocks}0.",)}[pattern]


def lora_config(pattern: str, config: Any = None) -> Any:
    """PEFT's LoRA (r=8) on every block's attention (and GPT-2's output projections), or on
    the first and the last block."""
    from peft import LoraConfig

    kind, layers = (config.model_type, config.num_hidden_layers) if config else ("gpt2", LAYERS)
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=FAMILY[kind][2],
                      fan_in_fan_out=kind == "gpt2",  # GPT-2's Conv1D stores weights transposed
                      layers_to_transform=None if pattern == "lora_all" else [0, layers - 1])


def load_model(pattern: str, folder: Path, wrap_lora: bool = True, cls: Any = None,
               streamed: bool = True) -> Any:
    """The model (``cls``, default GPT-2) as the pattern trains it: streamed onto meta
    (``streamed``: else ``cls.from_pretrained``), then frozen by name, or (LoRA) wrapped by
    PEFT (not when a trainer does the wrapping itself)."""
    from transformers import GPT2LMHeadModel

    from zero_strategy.transformers import from_pretrained

    cls = cls or GPT2LMHeadModel
    model = (from_pretrained(cls, folder) if streamed else cls.from_pretrained(folder)).train()
    if pattern.startswith("lora"):
        if wrap_lora:
            from peft import get_peft_model
            model = get_peft_model(model, lora_config(pattern, model.config))
        return model.train()
    prefixes = trained_prefixes(pattern, model.config)
    for name, p in model.named_parameters():
        p.requires_grad_(prefixes is None or name.startswith(prefixes))
    return model


def tokens(rank: int, steps: int = STEPS) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB, (steps * BATCH, SEQ), generator=g)


def activation_bytes(config: Any, batch: int = BATCH, checkpointing: bool = False) -> int:
    """The activation formula's peak for a step of ``batch`` rows (memory/activations.py)."""
    from zero_strategy import estimate_activations

    return estimate_activations(config, batch_size=batch, seq_len=SEQ,
                                checkpointing=checkpointing).peak_bytes


# -- measuring ------------------------------------------------------------------------------

def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":")) / 1024


class Meter:
    """Each phase's largest growth: the peak RSS since the phase began above the RSS then."""

    def __init__(self) -> None:
        self.growth: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.peak = 0.0
        """The highest RSS any phase reached (MiB)."""
        self.at = self._began = 0.0
        """``at``: the RSS when the phase began (MiB)."""

    def start(self, collect: bool = False) -> None:
        """``collect``: run the garbage collector first (a phase after one that dropped
        objects in reference cycles: a model, an engine; not needed inside a step, whose
        graph goes by reference counts, and it takes a tenth of a second)."""
        if collect:
            gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark (VmHWM) back to the current RSS (proc(5))
        self.at = _status_mib("VmRSS")
        self._began = time.perf_counter()

    def stop(self, phase: str) -> None:
        peak = _status_mib("VmHWM")
        self.peak = max(self.peak, peak)
        grown = peak - self.at
        self.growth[phase] = round(max(self.growth.get(phase, 0.0), grown), 1)
        spent = time.perf_counter() - self._began
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + spent, 2)


class Run:
    """One pattern's figures: growth and bound per phase (MiB), terms, losses."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.meter = Meter()
        self.bounds: dict[str, float] = {}
        self.terms: dict[str, float] = {}
        self.losses: list[float] = []

    def bound(self, engine: Any, activations: int, extra: Any = None,
              loaded_whole: bool = False) -> None:
        """The engine's bounds (``extra``: a frozen engine beside it, whose shards add to
        load and its units in flight to forward: it runs no backward, and its pool keeps
        the blocks its forward took). ``loaded_whole``: the model was loaded whole."""
        from zero_strategy.memory.phases import SLACK_BYTES

        b = engine.phase_bounds(activation_bytes=activations, loaded_whole=loaded_whole)
        bounds = {p: b.of(p) for p in PHASES}
        self.terms = {k: round(v / MIB, 1) for k, v in b.terms.items()}
        if extra is not None:
            e = extra.phase_bounds(activation_bytes=0)
            bounds["load"] += e.load - SLACK_BYTES
            bounds["forward"] += e.terms["gathered"]
            self.terms.update({f"reference_{k}": round(v / MIB, 1) for k, v in e.terms.items()})
        self.bounds = {p: round(v / MIB, 1) for p, v in bounds.items()}

    def record(self) -> dict[str, Any]:
        return {"growth": self.meter.growth, "bound": self.bounds, "terms": self.terms,
                "loss": self.losses, "phase_seconds": self.meter.seconds}


SAVE_ROOT = Path(tempfile.gettempdir())
"""Where saves and Trainer's output go (set from --out: the same on every rank)."""


def _save_dir(path: str, pattern: str) -> Path:
    return SAVE_ROOT / f"{path}-{pattern}"


# -- the paths ------------------------------------------------------------------------------

def _steps(run: Run, rank: int, forward: Callable[[torch.Tensor], torch.Tensor],
           backward: Callable[[torch.Tensor], None], step: Callable[[], None]) -> None:
    """The training loop of the paths a user writes by hand, each phase measured: ``forward``
    returns the loss, ``backward`` takes it, ``step`` clips, steps and zeroes."""
    for ids in tokens(rank).split(BATCH):
        run.meter.start()
        loss = forward(ids)
        run.meter.stop("forward")
        run.meter.start()
        backward(loss)
        run.meter.stop("backward")
        run.losses.append(float(loss.detach()))
        del loss
        run.meter.start()
        step()
        run.meter.stop("step")


def run_engine(run: Run, folder: Path) -> None:
    import zero_strategy as zs

    run.meter.start(collect=True)
    model = load_model(run.pattern, folder)
    engine = zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=LR),
                           zs.ZeroConfig(stage=3))
    run.meter.stop("load")
    run.bound(engine, activation_bytes(model.config))
    def step() -> None:
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()

    _steps(run, engine.comm.rank, lambda ids: engine(input_ids=ids, labels=ids).loss,
           engine.backward, step)
    save(run, lambda where: engine.save_pretrained(where), "engine")
    engine.close()


def run_accelerator(run: Run, folder: Path) -> None:
    from zero_strategy.accelerate import ZeroAccelerator, ZeroPlugin

    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=3))
    run.meter.start(collect=True)
    model = load_model(run.pattern, folder)
    wrapped, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    run.meter.stop("load")
    run.bound(accelerator.engine, activation_bytes(model.config))
    def step() -> None:
        accelerator.clip_grad_norm_(wrapped.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    _steps(run, accelerator.process_index, lambda ids: wrapped(input_ids=ids, labels=ids).loss,
           accelerator.backward, step)
    save(run, lambda where: accelerator.save_model(wrapped, where), "accelerator")
    accelerator.free_memory()


def run_fabric(run: Run, folder: Path) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="zero3")
    fabric.launch()
    run.meter.start(collect=True)
    net = load_model(run.pattern, folder)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=LR))
    run.meter.stop("load")
    engine = model._forward_module.engine
    run.bound(engine, activation_bytes(net.config))
    def step() -> None:
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()

    _steps(run, fabric.global_rank, lambda ids: model(input_ids=ids, labels=ids).loss,
           fabric.backward, step)
    save(run, lambda where: engine.save_pretrained(where), "fabric")
    engine.close()


def run_lightning(run: Run, folder: Path) -> None:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=2, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        gradient_clip_val=1.0)
    data = DataLoader(TensorDataset(tokens(trainer.global_rank)), batch_size=BATCH)
    run.meter.start(collect=True)
    trainer.fit(_lightning_module(run, folder), data)
    engine = trainer.strategy.engine
    save(run, lambda where: engine.save_pretrained(where), "lightning")
    engine.close()


def _lightning_module(run: Run, folder: Path) -> Any:
    import lightning.pytorch as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:  # streamed (LoRA too), as Lightning's docs say
            if self.model is None:
                self.model = load_model(run.pattern, folder)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)

        def on_train_start(self) -> None:
            run.meter.stop("load")
            run.bound(self.trainer.strategy.engine, activation_bytes(self.model.config))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            run.meter.start()
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            run.meter.stop("forward")
            return loss

        def on_before_backward(self, loss: torch.Tensor) -> None:
            run.losses.append(float(loss.detach()))
            run.meter.start()

        def on_after_backward(self) -> None:
            run.meter.stop("backward")
            run.meter.start()

        def on_train_batch_end(self, *args: Any) -> None:
            run.meter.stop("step")

    return Module()


# -- Trainer, TRL ---------------------------------------------------------------------------

def _bounds_at_start(run: Run, trainer: Any, activations: int,
                     reference: bool = False) -> Callable[[], None]:
    def bound() -> None:
        extra = getattr(trainer.ref_model, "engine", None) if reference else None
        run.bound(trainer.zero_engine, activations, extra)

    return bound


def watch(run: Run, trainer: Any, on_begin: Callable[[], None] | None = None) -> None:
    """Trainer's phases: load to ``on_train_begin`` (where ``on_begin`` runs: the engine
    exists), forward ``compute_loss``, backward ``accelerator.backward``, the step from there
    to ``on_step_end``."""
    from transformers import TrainerCallback

    compute_loss = trainer.compute_loss

    def forward(*args: Any, **kwargs: Any) -> Any:
        run.meter.start()
        out = compute_loss(*args, **kwargs)
        run.meter.stop("forward")
        loss = out[0] if isinstance(out, tuple) else out
        run.losses.append(float(loss.detach()))
        return out

    class Marks(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            run.meter.stop("load")
            if on_begin is not None:
                on_begin()
            backward = trainer.accelerator.backward

            def measured(*a: Any, **k: Any) -> None:
                run.meter.start()
                backward(*a, **k)
                run.meter.stop("backward")
                run.meter.start()  # the step: clipping, the optimizer, the schedule

            trainer.accelerator.backward = measured

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            run.meter.stop("step")

    trainer.compute_loss = forward
    trainer.add_callback(Marks())


def _arguments(config_class: Any, out: Path, **extra: Any) -> Any:
    return config_class(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS,
                        learning_rate=LR, max_grad_norm=1.0, report_to=[], save_strategy="no",
                        use_cpu=True, disable_tqdm=True, logging_steps=1, seed=1234,
                        **extra)


def run_trainer(run: Run, folder: Path) -> None:
    from torch.utils.data import Dataset
    from transformers import TrainingArguments

    from zero_strategy.transformers import ZeroPlugin, ZeroTrainer

    class Rows(Dataset):
        def __init__(self, rows: torch.Tensor) -> None:
            self.rows = rows

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    args = _arguments(TrainingArguments, _save_dir("trainer-run", run.pattern))
    run.meter.start(collect=True)
    model = load_model(run.pattern, folder)
    trainer = ZeroTrainer(model=model, args=args, train_dataset=Rows(tokens(0, 2 * STEPS)),
                          zero_plugin=ZeroPlugin(stage=3))
    watch(run, trainer, _bounds_at_start(run, trainer, activation_bytes(model.config)))
    trainer.train()
    save(run, trainer.save_model, "trainer")


def _words(n: int, length: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 1000, (n, length), generator=g)  # words the GPT-2 vocab holds
    return [" ".join(WORDS[i] for i in r) for r in rows.tolist()]


def run_sft(run: Run, folder: Path) -> None:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from zero_strategy.transformers import ZeroPlugin, with_zero

    lora = run.pattern.startswith("lora")
    args = _arguments(SFTConfig, _save_dir("sft-run", run.pattern), max_length=SEQ,
                      packing=False, bf16=False)
    run.meter.start(collect=True)
    model = load_model(run.pattern, folder, wrap_lora=False)
    trainer = with_zero(SFTTrainer)(
        model=model, args=args, processing_class=tokenizer(),
        train_dataset=Dataset.from_dict({"text": _words(2 * STEPS, SEQ - 1, 0)}),
        peft_config=lora_config(run.pattern) if lora else None,
        zero_plugin=ZeroPlugin(stage=3))
    watch(run, trainer, _bounds_at_start(
        run, trainer, activation_bytes(model.config, checkpointing=args.gradient_checkpointing)))
    trainer.train()
    save(run, trainer.save_model, "sft")


def run_reference(run: Run, folder: Path) -> None:
    from datasets import Dataset
    from transformers import GPT2LMHeadModel
    from trl import DPOConfig, DPOTrainer

    from zero_strategy.transformers import ZeroPlugin, from_pretrained, with_zero

    args = _arguments(DPOConfig, _save_dir("dpo-run", run.pattern), max_length=SEQ, bf16=False,
                      gradient_checkpointing=False)
    half = SEQ // 2 - 1
    data = Dataset.from_dict({"prompt": _words(2 * STEPS, half, 1),
                              "chosen": _words(2 * STEPS, half, 2),
                              "rejected": _words(2 * STEPS, half, 3)})
    run.meter.start(collect=True)
    policy = load_model(run.pattern, folder)
    reference = from_pretrained(GPT2LMHeadModel, folder)
    trainer = with_zero(DPOTrainer)(model=policy, ref_model=reference, args=args,
                                    processing_class=tokenizer(), train_dataset=data,
                                    zero_plugin=ZeroPlugin(stage=3))
    # chosen and rejected in one forward: twice the rows
    activations = activation_bytes(policy.config, batch=2 * BATCH)
    watch(run, trainer, _bounds_at_start(run, trainer, activations, reference=True))
    trainer.train()
    save(run, trainer.save_model, "reference")


RUNNERS: dict[str, Callable[[Run, Path], None]] = {
    "engine": run_engine, "accelerator": run_accelerator, "fabric": run_fabric,
    "lightning": run_lightning, "trainer": run_trainer, "sft": run_sft,
    "reference": run_reference}


def save(run: Run, write: Callable[[str], Any], path: str) -> None:
    """The streamed save into a fresh folder (deleted after: only its memory is of interest)."""
    import torch.distributed as dist

    where = _save_dir(path, run.pattern)
    dist.barrier()
    run.meter.start(collect=True)
    write(str(where))
    run.meter.stop("save")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where, ignore_errors=True)


def _import_for(path: str) -> None:
    """What the path's patterns import, imported before the first one is measured (the
    imports alone raise a process's memory by about 250 MiB)."""
    import peft  # noqa: F401
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401

    import zero_strategy.transformers  # noqa: F401
    if path in ("fabric", "lightning"):
        zero_strategy.register_strategies()  # zero3 for Trainer and Fabric
    if path in ("sft", "reference"):
        import datasets  # noqa: F401
        import trl  # noqa: F401


# -- main -----------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make-folder", type=Path, help="write the model there and exit")
    p.add_argument("--path", choices=PATHS)
    p.add_argument("--folder", type=Path, help="the model (--make-folder)")
    p.add_argument("--out", type=Path, help="where each rank writes rank<r>.json")
    p.add_argument("--patterns", help="comma-separated (default: every pattern of the path)")
    opts = p.parse_args()
    if opts.make_folder:
        print(f"{make_folder(opts.make_folder):,} parameters in {opts.make_folder}")
        return 0
    if opts.path is None or opts.folder is None or opts.out is None:
        p.error("--path, --folder and --out are needed (or --make-folder)")
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    global SAVE_ROOT
    shm = Path("/dev/shm")  # memory-backed where there is one: saves cost no disk time
    SAVE_ROOT = (shm if shm.is_dir() else opts.out) / f"zs-phase-{opts.out.name}"
    if opts.path == "engine":
        dist.init_process_group("gloo")
    _import_for(opts.path)
    default = ("reference",) if opts.path == "reference" else PATTERNS
    patterns = opts.patterns.split(",") if opts.patterns else list(default)
    results: dict[str, Any] = {}
    for pattern in patterns:
        run, start = Run(pattern), time.perf_counter()
        try:
            RUNNERS[opts.path](run, opts.folder)
            results[pattern] = {**run.record(), "seconds": round(time.perf_counter() - start, 1)}
        except Exception:
            traceback.print_exc()
            results[pattern] = {"error": traceback.format_exc()[-3000:]}
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized() and dist.get_rank() == 0:
        shutil.rmtree(SAVE_ROOT, ignore_errors=True)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(results))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
