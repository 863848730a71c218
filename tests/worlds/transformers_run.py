"""Trainer runs for the transformers integration's tests, launched under torchrun (N CPU
processes, gloo): ``python -m torch.distributed.run --nproc_per_node N this.py --out DIR
--only a,b``. Each named scenario trains a tiny GPT-2 (or TRL's SFTTrainer with a LoRA
adapter) under plain ``Trainer`` (DDP) or a ZeRO Trainer, in one launch, and rank 0 writes
``DIR/<scenario>.json``; the tests compare scenarios with each other and with single-process
references (tests/support/trainer_checks.py)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from zero_strategy.transformers import ZeroPlugin, ZeroTrainer, with_zero

SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {}
VOCAB = 64
STEPS = 4
MODES = {  # name: ZeroPlugin options, None for plain Trainer (DDP)
    "ddp": None, "z0": {"stage": 0}, "z1": {"stage": 1}, "z2": {"stage": 2},
    # Threshold 0: every parameter of this tiny model is under the default 10,000 elements
    # and would otherwise stay whole; stage 3 must really gather each one.
    "z3": {"stage": 3, "param_persistence_threshold": 0},
    "z3off": {"stage": 3, "param_persistence_threshold": 0, "offload_optimizer": True,
              "offload_params": True},
    # No generation budget: generate() gathers every unit per forward (streamed).
    "z3stream": {"stage": 3, "param_persistence_threshold": 0, "generation_gather_budget": 0},
    # Every module with parameters its own unit: what stays whole can be told apart.
    "z3units": {"stage": 3, "param_persistence_threshold": 0, "unit_numel": 1},
}
GENERATE_RANKS_NEW_TOKENS = (3, 9)  # ranks stop at different lengths: synced_gpus must hold


class Tokens(Dataset):
    """Fixed random token rows (the same on every rank; the sampler splits them)."""

    def __init__(self, n: int = 32, seq: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def tiny_gpt2(dropout: float = 0.1) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=2, resid_pdrop=dropout, embd_pdrop=dropout,
                                      attn_pdrop=dropout))


def arguments(out: Path, cls: type = TrainingArguments, **overrides: Any) -> TrainingArguments:
    values = dict(output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                  gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-3,
                  logging_steps=1, report_to=[], seed=0, max_grad_norm=0.5,
                  lr_scheduler_type="cosine", warmup_steps=1, dataloader_drop_last=True,
                  disable_tqdm=True, use_cpu=True, save_strategy="no")
    values.update(overrides)
    return cls(**values)


def trainer_for(mode: str, cls: type = Trainer, **kwargs: Any) -> Trainer:
    options = MODES[mode]
    if options is None:
        return cls(**kwargs)
    trainer_class = ZeroTrainer if cls is Trainer else with_zero(cls)
    return trainer_class(zero_plugin=ZeroPlugin(**options), **kwargs)


def history(trainer: Trainer) -> dict[str, Any]:
    logs = trainer.state.log_history
    return {"loss": [h["loss"] for h in logs if "loss" in h],
            "grad_norm": [h["grad_norm"] for h in logs if "grad_norm" in h],
            "eval_loss": [h["eval_loss"] for h in logs if "eval_loss" in h],
            "lr": [h["learning_rate"] for h in logs if "learning_rate" in h]}


def scenario(fn: Callable[[Path], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------------------------- fit
def _fit(mode: str, out: Path, tag: str = "fit", **overrides: Any) -> dict[str, Any]:
    """Train with accumulation, clipping, a warm-up + cosine schedule, evaluation and a
    checkpoint every 2 steps; then save_model and predict."""
    run = out / f"{tag}_{mode}"
    trainer = trainer_for(mode, model=tiny_gpt2(), train_dataset=Tokens(),
                          eval_dataset=Tokens(8, seed=1),
                          args=arguments(run, eval_strategy="steps", eval_steps=2,
                                         save_strategy="steps", save_steps=2, **overrides))
    trainer.train()
    trainer.save_model(str(run / "final"))
    predictions = trainer.predict(Tokens(8, seed=2))
    torch.save(torch.as_tensor(predictions.predictions), run / "predictions.pt")
    engine = getattr(trainer, "zero_engine", None)
    report = engine.memory_report() if engine is not None else {}
    return {**history(trainer), "final": str(run / "final"), "run": str(run),
            "checkpointed": report.get("checkpointed_modules"),
            "offloaded": report.get("offloaded_activation_bytes"),
            "hf_checkpointing": trainer.model.is_gradient_checkpointing,
            "predictions": str(run / "predictions.pt"),
            "test_loss": predictions.metrics["test_loss"],
            "checkpoints": sorted(p.name for p in run.glob("checkpoint-*"))}


def _resume(mode: str, out: Path) -> dict[str, Any]:
    """The fit run again from its checkpoint-2 (written under ``mode``), to the same end."""
    run = out / f"resume_{mode}"
    trainer = trainer_for(mode, model=tiny_gpt2(), train_dataset=Tokens(),
                          eval_dataset=Tokens(8, seed=1),
                          args=arguments(run, eval_strategy="steps", eval_steps=2))
    trainer.train(resume_from_checkpoint=str(out / f"fit_{mode}" / "checkpoint-2"))
    trainer.save_model(str(run / "final"))
    return {**history(trainer), "final": str(run / "final")}


for _mode in MODES:
    SCENARIOS[f"fit_{_mode}"] = functools.partial(_fit, _mode)
    SCENARIOS[f"resume_{_mode}"] = functools.partial(_resume, _mode)

# Activation checkpointing, dropout on: plain Trainer through transformers' own switch,
# ZeroTrainer through the plugin (the layers' inputs on disk); the same functions recomputed.
MODES["z3ckpt"] = {**MODES["z3"], "activation_checkpointing": True, "offload_activations": "disk"}
SCENARIOS["ckpt_ddp"] = functools.partial(
    _fit, "ddp", tag="ckpt", gradient_checkpointing=True,
    gradient_checkpointing_kwargs={"use_reentrant": False})
SCENARIOS["ckpt_z3"] = functools.partial(_fit, "z3ckpt", tag="ckpt")


def _best(mode: str, out: Path) -> dict[str, Any]:
    """Evaluate and save every step with ReduceLROnPlateau, keep one checkpoint besides the
    best, and load the best model at the end; a callback records what it is shown."""
    seen: dict[str, list[Any]] = {"lr": [], "saved": []}

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                        **kwargs: Any) -> None:
            seen["lr"].append(optimizer.param_groups[0]["lr"])

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen["saved"].append(state.global_step)

    run = out / f"best_{mode}"
    trainer = trainer_for(mode, model=tiny_gpt2(), train_dataset=Tokens(),
                          eval_dataset=Tokens(8, seed=1), callbacks=[Record()],
                          args=arguments(run, eval_strategy="steps", eval_steps=1,
                                         save_strategy="steps", save_steps=1,
                                         save_total_limit=1, load_best_model_at_end=True,
                                         metric_for_best_model="eval_loss",
                                         lr_scheduler_type="reduce_lr_on_plateau",
                                         lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
                                         learning_rate=3e-2, max_steps=5, warmup_steps=0))
    trainer.train()
    trainer.save_model(str(run / "final"))
    return {**history(trainer), **seen, "final": str(run / "final"),
            "best": Path(trainer.state.best_model_checkpoint).name,
            "checkpoints": sorted(p.name for p in run.glob("checkpoint-*"))}


def _precision(mode: str, out: Path) -> dict[str, Any]:
    """Trainer's bf16/fp16 flags choose the engine's precision; a plugin that says otherwise is
    refused naming both. Nothing is trained."""
    result: dict[str, Any] = {}
    for flag in ("bf16", "fp16"):
        trainer = trainer_for("z3", model=tiny_gpt2(), train_dataset=Tokens(),
                              args=arguments(out / f"precision_{flag}", **{flag: True}))
        result[flag] = trainer.accelerator.zero_config.precision
    try:
        ZeroTrainer(model=tiny_gpt2(), train_dataset=Tokens(), args=arguments(
            out / "precision_clash", bf16=True), zero_plugin=ZeroPlugin(precision="32-true"))
        result["clash"] = None
    except ValueError as err:
        result["clash"] = str(err)
    return result


# Every lr_scheduler_type Trainer knows but the metric-driven ones (reduce_lr_on_plateau:
# _best; greedy likewise steps on the evaluation metric), with the kwargs each requires.
SCHEDULES = {"linear": {}, "cosine": {}, "cosine_with_restarts": {"num_cycles": 2},
             "polynomial": {"power": 2.0}, "constant": {}, "constant_with_warmup": {},
             "inverse_sqrt": {}, "cosine_with_min_lr": {"min_lr": 1e-4},
             "cosine_warmup_with_min_lr": {"min_lr": 1e-4},
             "warmup_stable_decay": {"num_decay_steps": 2}}


def _schedules(mode: str, out: Path) -> dict[str, Any]:
    """Each schedule for 4 steps with a warm-up step: Trainer's scheduler acts on the
    optimizer Trainer built, whose groups the engine reads at every step."""
    result = {}
    for name, kwargs in SCHEDULES.items():
        trainer = trainer_for(mode, model=tiny_gpt2(), train_dataset=Tokens(),
                              args=arguments(out / f"schedule_{mode}_{name}",
                                             lr_scheduler_type=name, lr_scheduler_kwargs=kwargs))
        trainer.train()
        result[name] = history(trainer)
    return result


SCENARIOS["schedules_ddp"] = functools.partial(_schedules, "ddp")
SCENARIOS["schedules_z3"] = functools.partial(_schedules, "z3")
SCENARIOS["best_ddp"] = functools.partial(_best, "ddp")
SCENARIOS["best_z3"] = functools.partial(_best, "z3")
SCENARIOS["precision"] = functools.partial(_precision, "z3")


def _pretrained_folder(out: Path) -> Path:
    """The tiny GPT-2 saved with ``save_pretrained`` under ``out``. No process group exists
    before the first Trainer (users call from_pretrained first): rank 0 publishes the folder
    by a rename, the others wait for it."""
    folder = out / "pretrained"
    if os.environ["RANK"] == "0" and not folder.exists():
        tiny_gpt2().save_pretrained(out / "pretrained.tmp")
        (out / "pretrained.tmp").rename(folder)
    while not folder.exists():
        time.sleep(0.05)
    return folder


def _streamed(mode: str, out: Path, evaluate_first: bool = False,
              train: bool = True) -> dict[str, Any]:
    """A pretrained folder: plain Trainer gets ``GPT2LMHeadModel.from_pretrained``, a ZeRO
    Trainer our ``from_pretrained`` (built on meta, each rank reading its own ranges); then
    optionally ``evaluate()`` before training (the engine must be built for it), training,
    and ``save_model``."""
    from zero_strategy.transformers import from_pretrained

    folder = _pretrained_folder(out)
    run = out / f"streamed_{mode}_{int(evaluate_first)}{int(train)}"
    model = (GPT2LMHeadModel.from_pretrained(folder) if MODES[mode] is None
             else from_pretrained(GPT2LMHeadModel, folder))
    on_meta = any(p.is_meta for p in model.parameters())
    trainer = trainer_for(mode, model=model, train_dataset=Tokens(),
                          eval_dataset=Tokens(8, seed=1), args=arguments(run))
    before = trainer.evaluate()["eval_loss"] if evaluate_first else None
    if train:
        trainer.train()
        trainer.save_model(str(run / "final"))
    return {**history(trainer), "eval_before": before, "built_on_meta": on_meta,
            "final": str(run / "final")}


SCENARIOS["streamed_ddp"] = functools.partial(_streamed, "ddp")
SCENARIOS["streamed_z3"] = functools.partial(_streamed, "z3")
# Plain Trainer (transformers 5.23) never wraps a model evaluated before train() in DDP: its
# ranks then train apart. Its evaluation alone is the reference; training after an early
# evaluation is compared between the engine replicated (stage 0) and stage 3.
SCENARIOS["evaluated_ddp"] = functools.partial(_streamed, "ddp", evaluate_first=True, train=False)
SCENARIOS["evaluated_z0"] = functools.partial(_streamed, "z0", evaluate_first=True)
SCENARIOS["evaluated_z3"] = functools.partial(_streamed, "z3", evaluate_first=True)


def _no_decay_only(mode: str, out: Path, streamed: bool = False) -> dict[str, Any]:
    """Bias and LayerNorm tuning: everything else frozen, so Trainer's weight-decay group (its
    first) is empty. Streamed: a pretrained folder (``from_pretrained`` on meta for ZeRO) with
    only the final LayerNorm trained."""
    if streamed:
        from zero_strategy.transformers import from_pretrained

        folder = _pretrained_folder(out)
        model = (GPT2LMHeadModel.from_pretrained(folder) if MODES[mode] is None
                 else from_pretrained(GPT2LMHeadModel, folder))
    else:
        model = tiny_gpt2()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("transformer.ln_f.") if streamed
                         else name.endswith(".bias") or ".ln_" in name)
    run = out / f"nodecay_{mode}_{int(streamed)}"
    trainer = trainer_for(mode, model=model, train_dataset=Tokens(),
                          args=arguments(run, learning_rate=1e-2, weight_decay=0.1))
    trainer.train()
    trainer.save_model(str(run / "final"))
    groups = [len(g["params"]) for g in trainer.optimizer.param_groups]
    return {**history(trainer), "final": str(run / "final"), "group_sizes": groups,
            "trained": sorted(n for n, p in model.named_parameters() if p.requires_grad)}


for _mode in ("ddp", "z1", "z3"):
    SCENARIOS[f"nodecay_{_mode}"] = functools.partial(_no_decay_only, _mode)
SCENARIOS["nodecay_streamed_ddp"] = functools.partial(_no_decay_only, "ddp", streamed=True)
SCENARIOS["nodecay_streamed_z3"] = functools.partial(_no_decay_only, "z3", streamed=True)


# ---------------------------------------------------------------------------------- frozen units
FROZEN_PATTERNS = {"head": ("transformer.ln_f.",), "first_block": ("transformer.ln_f.",
                                                                   "transformer.h.0.")}
"""Partial fine-tunes: the final LayerNorm alone (Trainer's decay group empty; nothing before
it trains, so no block needs a backward), and with the first block (backward crosses every
frozen block after it)."""


def _frozen(mode: str, out: Path) -> dict[str, Any]:
    """Each pattern for 3 steps; under ZeRO, what stays whole: the units still gathered when
    the forward returns, those gathered when the first gradient of the first block arrives
    (every frozen block behind it in backward by then), and the units holding a gradient
    shard after the step."""
    results = {}
    for pattern, trained in FROZEN_PATTERNS.items():
        model = tiny_gpt2()
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(trained))
        trainer = trainer_for(mode, model=model, train_dataset=Tokens(),
                              args=arguments(out / f"frozen_{mode}_{pattern}", max_steps=3,
                                             learning_rate=1e-2, gradient_accumulation_steps=1,
                                             warmup_steps=0, lr_scheduler_type="constant"))
        seen: dict[str, list[list[str]]] = {"after_forward": [], "in_backward": [],
                                            "grads": []}
        if MODES[mode] is not None:
            _watch_units(trainer, model, seen)
        trainer.train()
        results[pattern] = {**history(trainer), **seen}
    return results


def _watch_units(trainer: Any, model: GPT2LMHeadModel, seen: dict[str, list]) -> None:
    def whole() -> list[str]:
        return sorted(u.name for u in trainer.zero_engine.units
                      if u.param_store.state.value == "unsharded")

    compute_loss = trainer.compute_loss

    def measured(*args: Any, **kwargs: Any) -> Any:
        loss = compute_loss(*args, **kwargs)
        seen["after_forward"].append(whole())
        return loss

    trainer.compute_loss = measured
    first = [p for n, p in model.named_parameters() if n.startswith("transformer.h.0.")]

    class Watch(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            # Registered after the engine's own hook: a sample per arriving gradient.
            for p in first:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        lambda _: seen["in_backward"].append(whole()))

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            seen["grads"].append(sorted(u.name for u in trainer.zero_engine.units
                                        if u.grad_store.held_tensors()))

    trainer.add_callback(Watch())


for _mode in ("ddp", "z3units"):
    SCENARIOS[f"frozen_{_mode}"] = functools.partial(_frozen, _mode)


# ---------------------------------------------------------------------------------- TRL + LoRA
WORDS = [f"w{i}" for i in range(VOCAB - 3)]


def word_tokenizer() -> Any:
    """A word-level tokenizer built in code (no download): TRL's SFTTrainer needs one."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def texts(n: int = 32, seed: int = 0) -> Any:
    from datasets import Dataset as HFDataset

    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, len(WORDS), (n, 12), generator=g)
    return HFDataset.from_dict({"text": [" ".join(WORDS[i] for i in r) for r in rows.tolist()]})


def _sft_lora(mode: str, out: Path, trl_precision: bool = False) -> dict[str, Any]:
    """TRL's SFTTrainer with a LoRA adapter on a frozen GPT-2 base."""
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    run = out / f"sft_{mode}{'_bf16' if trl_precision else ''}"
    # TRL turns activation checkpointing and bf16 on by default. Checkpointing is kept (part
    # of what is tested); bf16 is kept only with ``trl_precision`` (TRL's default config as a
    # user gets it, 6 steps), else parity is asserted in fp32, the tighter bound.
    precision = {"max_steps": 6} if trl_precision else {"bf16": False}
    config = arguments(run, SFTConfig, max_length=16, packing=False, **precision)
    trainer = trainer_for(mode, SFTTrainer, model=tiny_gpt2(), args=config,
                          train_dataset=texts(), processing_class=word_tokenizer(),
                          peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["c_attn", "c_proj"],
                                                 fan_in_fan_out=True))
    trainer.train()
    trainer.save_model(str(run / "adapter"))
    result = {**history(trainer), "adapter": str(run / "adapter"), "bf16": config.bf16}
    engine = getattr(trainer, "zero_engine", None)
    if engine is not None:
        report = engine.memory_report()
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        result.update(optimizer_state_elements=_state_elements(engine), trainable=trainable,
                      report={k: v for k, v in report.items() if isinstance(v, (int, float))},
                      world=dist.get_world_size())
    return result


def _state_elements(engine: Any) -> int:
    """Optimizer state elements this rank holds, summed over ranks."""
    held = 0
    for part in engine.optimizer.parts:
        for state in part.inner.state.values():
            held += sum(v.numel() for v in state.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)
    total = torch.tensor([held])
    dist.all_reduce(total)
    return int(total.item())


for _mode in MODES:
    SCENARIOS[f"sft_{_mode}"] = functools.partial(_sft_lora, _mode)
    SCENARIOS[f"sft_bf16_{_mode}"] = functools.partial(_sft_lora, _mode, trl_precision=True)
# The engine's compute copies chosen in the plugin beside TRL's bf16=True: the other arithmetic.
MODES["z3copies"] = {**MODES["z3"], "precision": "bf16-mixed"}
SCENARIOS["sft_bf16_z3copies"] = functools.partial(_sft_lora, "z3copies", trl_precision=True)


# ---------------------------------------------------------------------------------- generate
def _generate(mode: str, out: Path) -> dict[str, Any]:
    """After training, each rank generates greedily from its own prompt for its own number of
    tokens; the unsharded model (the consolidated weights in a plain copy, generating alone)
    must produce the same tokens. Counts the forwards and the all-gather bytes of the call."""
    trainer = trainer_for(mode, model=tiny_gpt2(), train_dataset=Tokens(), args=arguments(
        out / f"generate_{mode}", max_steps=2))
    trainer.train()
    rank = dist.get_rank()
    prompt = Tokens(2, seq=5, seed=7).rows[rank : rank + 1]
    new = GENERATE_RANKS_NEW_TOKENS[rank % len(GENERATE_RANKS_NEW_TOKENS)]
    model = trainer.model.eval()
    engine = getattr(trainer, "zero_engine", None)
    forwards = []
    handle = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    before = dict(engine.shards.bytes_sent) if engine is not None else {}
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                pad_token_id=0)
    seconds = time.perf_counter() - start
    handle.remove()
    after = dict(engine.shards.bytes_sent) if engine is not None else {}
    reference = tiny_gpt2().eval()
    state = engine.full_state_dict() if engine is not None else trainer.model.state_dict()
    reference.load_state_dict(state)
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False, pad_token_id=0, synced_gpus=False)
    equal = torch.tensor([int(torch.equal(tokens, expected))])
    dist.all_reduce(equal)
    gathered = {k: after[k] - before.get(k, 0) for k in after}
    param_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    units = [u for u in engine.units if u.param_store.gathers] if engine is not None else []
    return {"ranks_equal": int(equal.item()), "world": dist.get_world_size(),
            "forwards": len(forwards), "new_tokens": new, "comm": gathered,
            "gathered_units": len(units),
            "param_bytes": param_bytes, "tokens_per_s": new / seconds}


for _mode in ("ddp", "z2", "z3", "z3stream"):
    SCENARIOS[f"generate_{_mode}"] = functools.partial(_generate, _mode)


def _predict_with_generate(mode: str, out: Path) -> dict[str, Any]:
    """Seq2SeqTrainer(predict_with_generate=True): predict() generates on every rank's rows
    (transformers picks synced_gpus from the model) and gathers the tokens."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    run = out / f"seq2seq_{mode}"
    args = arguments(run, Seq2SeqTrainingArguments, max_steps=2, predict_with_generate=True,
                     generation_max_length=14)
    model = tiny_gpt2()
    # An end token the greedy decode meets at different lengths on different rows (and
    # ranks): the padding, and synced_gpus while one rank is done and the other is not.
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id = 0, 7
    trainer = trainer_for(mode, Seq2SeqTrainer, model=model, args=args, train_dataset=Tokens())
    trainer.train()
    engine = getattr(trainer, "zero_engine", None)
    before = engine.comm_bytes().get("all_gather", 0) if engine is not None else 0
    tokens = trainer.predict(Tokens(8, seq=6, seed=3)).predictions
    torch.save(torch.as_tensor(tokens), run / "tokens.pt")
    result: dict[str, Any] = {"tokens": str(run / "tokens.pt")}
    if engine is not None:  # generate() went through the generation mode: units held
        units = [u for u in engine.units if u.param_store.gathers]
        result.update(held=len(engine.generation_mode.last_held), units=len(units),
                      gathered=engine.comm_bytes()["all_gather"] - before)
    return result


SCENARIOS["seq2seq_ddp"] = functools.partial(_predict_with_generate, "ddp")
SCENARIOS["seq2seq_z3"] = functools.partial(_predict_with_generate, "z3")


# ---------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", required=True, help="comma-separated scenario names, in order")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    for name in opts.only.split(","):
        start = time.perf_counter()
        try:
            result = SCENARIOS[name](opts.out)
        except Exception:
            result = {"error": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - start, 2)
        if int(os.environ.get("RANK", "0")) == 0 or "error" in result:
            rank = os.environ.get("RANK", "0")
            suffix = "" if rank == "0" else f".rank{rank}"
            (opts.out / f"{name}{suffix}.json").write_text(json.dumps(result))
        if "error" in result:
            print(result["error"], file=sys.stderr)
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
