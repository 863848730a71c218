"""TRL's online trainers (GRPO, RLOO, online DPO) for tests/integration/test_trl_online.py,
launched under torchrun (N CPU processes, gloo) as tests/worlds/transformers_run.py is:
``python -m torch.distributed.run --nproc_per_node N this.py --out DIR --only a,b``. Each
scenario trains a tiny GPT-2 from a local pretrained folder (TRL builds the reference model
from it) with a python reward function, under plain ``Trainer`` (DDP) or a ZeRO trainer
(``with_zero``), and rank 0 writes ``DIR/<scenario>.json``.

Everything runs in fp32 (``bf16=False`` explicitly, TRL's configs default to bf16) with
dropout off, so a ZeRO run and the DDP run draw the same samples: generation samples with
the global torch generator, seeded alike on every rank by Trainer, and the engine's
stage-3 generation consumes it as plain ``generate()`` does (``generation_rng`` records it).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.worlds import transformers_run as T
from zero_strategy.transformers import ZeroPlugin, with_zero

SCENARIOS = T.SCENARIOS
SCENARIOS.clear()  # this launch runs TRL's online trainers only
STEPS = 3
MODES = {
    "ddp": None,
    "z2": {"stage": 2},
    # Threshold 0: every parameter of the tiny model is gathered (none kept whole).
    "z3": {"stage": 3, "param_persistence_threshold": 0},
    # No generation budget: every generate() forward gathers (streamed), with synced_gpus.
    "z3stream": {"stage": 3, "param_persistence_threshold": 0, "generation_gather_budget": 0},
    "z3off": {"stage": 3, "param_persistence_threshold": 0, "offload_optimizer": True,
              "offload_params": True},
}


def reward_distinct(completions: list[Any], **kwargs: Any) -> list[float]:
    """Distinct words per completion, scaled: a reward that differs between samples of one
    prompt, so advantages (and the policy gradient) are not zero."""
    return [len(set(str(c).split())) / 4.0 for c in completions]


def prompts(n: int = 16, seed: int = 3) -> Any:
    from datasets import Dataset as HFDataset

    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, len(T.WORDS), (n, 4), generator=g)
    return HFDataset.from_dict({"prompt": [" ".join(T.WORDS[i] for i in r)
                                           for r in rows.tolist()]})


def _folder(out: Path) -> Path:
    """The tiny GPT-2 (dropout off) saved with save_pretrained, published by rank 0 by a
    rename: GRPO and RLOO load their reference model from the policy's folder."""
    folder = out / "pretrained"
    if os.environ["RANK"] == "0" and not folder.exists():
        model = T.tiny_gpt2(dropout=0.0)
        for config in (model.config, model.generation_config):
            config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 1
        model.save_pretrained(out / "pretrained.tmp")
        (out / "pretrained.tmp").rename(folder)
    while not folder.exists():
        import time

        time.sleep(0.05)
    return folder


def _trainer(mode: str, cls: type, **kwargs: Any) -> Any:
    options = MODES[mode]
    if options is None:
        return cls(**kwargs)
    return with_zero(cls)(zero_plugin=ZeroPlugin(**options), **kwargs)


def _common(run: Path) -> dict[str, Any]:
    return dict(output_dir=str(run), per_device_train_batch_size=4, max_steps=STEPS,
                learning_rate=1e-3, logging_steps=1, report_to=[], seed=0, max_grad_norm=0.5,
                disable_tqdm=True, use_cpu=True, save_strategy="no", bf16=False,
                lr_scheduler_type="constant")


def _history(trainer: Any, keys: tuple[str, ...]) -> dict[str, list[float]]:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {k: [h[k] for h in logs if k in h] for k in ("loss", "grad_norm", *keys)}


def _ref_facts(trainer: Any) -> dict[str, Any]:
    """How the reference model is held: its parameter bytes on this rank (the shard only at
    stage 3), summed over ranks, trainable elements, optimizer state, and the model's size."""
    ref = getattr(trainer, "ref_model", None)
    if ref is None:
        return {"ref": None}
    engine = getattr(ref, "engine", None)
    module = getattr(ref, "module", ref)
    if engine is not None:
        report = engine.memory_report()
        held = report["params_bytes"] + report["optimizer_bytes"]
        extra = report["grads_bytes"] + report["optimizer_bytes"]
        states = sum(len(part.inner.state) for part in engine.optimizer.parts)
    else:
        held = sum(p.numel() * p.element_size() for p in module.parameters())
        extra = states = 0
    total = torch.tensor([held, states, extra])
    dist.all_reduce(total)
    # fp32 bytes of the whole model: parameters keep their full shapes at stage 3 too
    whole = sum(p.numel() * 4 for p in module.parameters())
    from zero_strategy.checkpoint.pretrained import spec_of

    return {"ref": type(ref).__name__, "ref_bytes_rank": held,
            "ref_streamed": spec_of(module) is not None, "ref_bytes_sum": int(total[0]),
            "ref_states": int(total[1]), "ref_grads_optimizer_bytes": int(total[2]),
            "model_bytes": whole,
            "ref_trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "world": dist.get_world_size()}


def _reward_model() -> Any:
    """A tiny GPT-2 scoring sequences (one label), built in code: no download."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(1)
    return GPT2ForSequenceClassification(GPT2Config(
        vocab_size=T.VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, num_labels=1,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _held(model: Any) -> dict[str, Any]:
    """A prepared evaluation-only model: its kind and the parameter bytes this rank holds."""
    engine = getattr(model, "engine", None)
    module = getattr(model, "module", model)
    held = (engine.memory_report()["params_bytes"] if engine is not None else
            sum(p.numel() * p.element_size() for p in module.parameters()))
    return {"type": type(model).__name__, "bytes_rank": held,
            "whole": sum(p.numel() * 4 for p in module.parameters())}  # fp32, full shapes


def _finish(trainer: Any, run: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    # The global generator as training left it, before anything here could draw from it:
    # every sample generation took moved it, so equal states mean equal consumption.
    rng = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()
    trainer.save_model(str(run / "final"))
    return {**_history(trainer, keys), **_ref_facts(trainer), "final": str(run / "final"),
            "rng": rng}


# ---------------------------------------------------------------------------------- GRPO
def _grpo(mode: str, out: Path, lora: bool = False, tag: str = "",
          reward_model: bool = False, **config: Any) -> dict[str, Any]:
    """GRPO with a reference model (beta 0.1); ``lora``: a LoRA adapter (the base is the
    reference); ``reward_model``: a sequence-classification GPT-2 beside the python reward."""
    from trl import GRPOConfig, GRPOTrainer

    run = out / "_".join(["grpo", *(["lora"] if lora else []), *([tag] if tag else []), mode])
    args = GRPOConfig(**{**_common(run), **config}, num_generations=4, max_completion_length=6,
                      beta=0.1, temperature=1.0, disable_dropout=True)
    extra: dict[str, Any] = {}
    rewards: list[Any] = [reward_distinct]
    if reward_model:
        rewards.append(_reward_model())
        extra["reward_processing_classes"] = [None, T.word_tokenizer()]
    if lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                          target_modules=["c_attn", "c_proj"],
                                          fan_in_fan_out=True)
    folder = _folder(out)
    with _counting_models() as built:
        trainer = _trainer(mode, GRPOTrainer, model=str(folder), reward_funcs=rewards,
                           args=args, train_dataset=prompts(),
                           processing_class=T.word_tokenizer(), **extra)
        trainer.train()
    result = _finish(trainer, run, ("reward", "kl", "completions/mean_length"))
    result["models"] = len(built)
    if reward_model:
        result["reward_model"] = _held(trainer.reward_funcs[1])
    if lora:
        result.update(_lora_facts(trainer, run / "final"))
    return result


@contextlib.contextmanager
def _counting_models() -> Iterator[list[int]]:
    """The GPT-2 models built inside the block (policy, reference), by their constructor."""
    from transformers import GPT2LMHeadModel

    built: list[int] = []
    original = GPT2LMHeadModel.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(id(self))
        original(self, *args, **kwargs)

    GPT2LMHeadModel.__init__ = counted
    try:
        yield built
    finally:
        GPT2LMHeadModel.__init__ = original


def _lora_facts(trainer: Any, saved: Path) -> dict[str, Any]:
    """With LoRA, only the adapter is saved, and at stage 3 the policy (frozen base included)
    is held 1/N per rank."""
    dist.barrier()  # rank 0 wrote the adapter
    engine = getattr(trainer, "zero_engine", None)
    held = engine.memory_report()["params_bytes"] if engine is not None else 0
    total = torch.tensor([held])
    dist.all_reduce(total)
    return {"adapter_only": all("lora_" in k for k in _saved_keys(saved)),
            "policy_bytes_rank": held, "policy_bytes_sum": int(total.item()),
            "policy_numel": engine.num_params if engine is not None else None}


def _saved_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    name = "adapter_model.safetensors"
    with safe_open(str(folder / name), "pt") as f:
        return list(f.keys())


for _mode in MODES:
    SCENARIOS[f"grpo_{_mode}"] = functools.partial(_grpo, _mode)
for _mode in ("ddp", "z3"):
    SCENARIOS[f"grpo_lora_{_mode}"] = functools.partial(_grpo, _mode, lora=True)


# ---------------------------------------------------------------------------------- RLOO
def _rloo(mode: str, out: Path) -> dict[str, Any]:
    from trl import RLOOConfig, RLOOTrainer

    run = out / f"rloo_{mode}"
    args = RLOOConfig(**_common(run), num_generations=4, max_completion_length=6, beta=0.1,
                      disable_dropout=True)
    trainer = _trainer(mode, RLOOTrainer, model=str(_folder(out)), reward_funcs=reward_distinct,
                       args=args, train_dataset=prompts(), processing_class=T.word_tokenizer())
    trainer.train()
    return _finish(trainer, run, ("reward", "kl"))


for _mode in ("ddp", "z2", "z3"):
    # TRL's sync_ref_model every step, half-way: the reference follows the policy.
    SCENARIOS[f"grpo_sync_{_mode}"] = functools.partial(
        _grpo, _mode, tag="sync", sync_ref_model=True, ref_model_sync_steps=1,
        ref_model_mixup_alpha=0.5)
for _mode in ("ddp", "z3"):
    # TRL's default precision: bf16=True, autocast over fp32 weights under DDP and under the
    # engine ("bf16-autocast"), the reference's forward too.
    SCENARIOS[f"grpo_bf16_{_mode}"] = functools.partial(_grpo, _mode, tag="bf16", bf16=True)
for _mode in ("ddp", "z3"):
    SCENARIOS[f"grpo_rm_{_mode}"] = functools.partial(_grpo, _mode, tag="rm", reward_model=True)


for _mode in ("ddp", "z3"):
    SCENARIOS[f"rloo_{_mode}"] = functools.partial(_rloo, _mode)


# ---------------------------------------------------------------------------------- online DPO
def _online_dpo(mode: str, out: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    run = out / f"odpo_{mode}"
    args = OnlineDPOConfig(**_common(run), max_new_tokens=6, beta=0.1, disable_dropout=True)
    model = AutoModelForCausalLM.from_pretrained(_folder(out))
    trainer = _trainer(mode, OnlineDPOTrainer, model=model, reward_funcs=reward_distinct,
                       args=args, train_dataset=prompts(), processing_class=T.word_tokenizer())
    trainer.train()
    return _finish(trainer, run, ("objective/kl", "rewards/margins", "objective/scores",
                                         "val/contain_eos_token"))


for _mode in ("ddp", "z2", "z3"):
    SCENARIOS[f"odpo_{_mode}"] = functools.partial(_online_dpo, _mode)


if __name__ == "__main__":
    T.main()
