"""An ordinary Accelerate training loop, trained with ZeRO by swapping in ``ZeroAccelerator``.

    ZERO_STRATEGY_CONFIG=conf/accelerate/zero3.yaml \\
        accelerate launch --config_file conf/accelerate/multi_process.yaml \\
        recipes/accelerate_train.py --model gpt2 --steps 50

    # the same loop under plain Accelerate DDP, for comparison
    accelerate launch --config_file conf/accelerate/multi_process.yaml \\
        recipes/accelerate_train.py --mode ddp --model gpt2 --steps 50

The ZeRO options come from ``--zero-config`` or ``$ZERO_STRATEGY_CONFIG`` (a YAML of
ZeroConfig fields), overridden by ``--zero-opt key=value``. ``--save-at K --save-dir D`` saves
the state after K optimizer steps; ``--resume D`` loads it and continues where it stopped.

Fault tolerance: ``--checkpoint-every N --checkpoint-dir D`` saves the state every N steps
(``D/step-<k>``, the two newest complete ones kept) and, started again, resumes from the newest
complete one. Launched with restarts, a worker lost mid-run makes the launcher restart all of
them and the job ends with the weights of an uninterrupted run::

    ZERO_STRATEGY_CONFIG=conf/accelerate/zero3.yaml \\
        accelerate launch --max_restarts 3 --config_file conf/accelerate/multi_process.yaml \\
        recipes/accelerate_train.py --checkpoint-every 10 --checkpoint-dir ckpt

(``--max_restarts`` cannot be set in Accelerate's config file.)
``--export-dir D`` saves the trained model for inference with ``accelerator.save_model`` (every
rank calls it; the weights are consolidated from the shards) and, for GPT-2, its config, so
``GPT2LMHeadModel.from_pretrained(D)`` loads it.
``--out DIR`` writes each rank's losses, gradient norms and (rank 0) final weights as JSON.
Models: a tiny GPT-2 on the help text that ships with Python (``--model gpt2``, needs
transformers) or a small MLP on synthetic regression data (``--model mlp``, used by the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=["zero", "ddp"], default="zero")
    p.add_argument("--zero-config", default=None,
                   help="plugin YAML (default: $ZERO_STRATEGY_CONFIG)")
    p.add_argument("--zero-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="override one ZeroConfig field in code (value parsed as YAML)")
    p.add_argument("--model", choices=["gpt2", "mlp"], default="gpt2")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch", type=int, default=4, help="samples per rank per micro-batch")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--shuffle", action="store_true", help="shuffle the training data")
    p.add_argument("--save-at", type=int, default=None, help="save_state after this many steps")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--resume", default=None, help="load_state from this folder and continue")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save the state every N optimizer steps into --checkpoint-dir and "
                        "resume from the newest complete one when started again")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--export-dir", default=None,
                   help="after training, save the consolidated model for inference: "
                        "accelerator.save_model (model.safetensors) plus, for GPT-2, its config, "
                        "so GPT2LMHeadModel.from_pretrained(DIR) loads it; the main process "
                        "reads it back and checks it against accelerator.get_state_dict")
    p.add_argument("--out", default=None, help="folder for per-rank JSON results")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ models and data
class Output(dict):
    """A dict with attribute access, like transformers' ModelOutput: ``model(**batch).loss``."""

    __getattr__ = dict.__getitem__


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 64, d_out: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                                 nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Output:
        logits = self.net(x)
        return Output(logits=logits, loss=nn.functional.mse_loss(logits, labels))


class Regression(Dataset):
    """Targets 3x a fixed linear map: gradients large enough that clipping at 1.0 engages."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = 3.0 * self.x @ torch.randn(16, 8, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class HelpText(Dataset):
    """Consecutive 64-byte windows of the English help topics in ``pydoc_data`` (vocab 256)."""

    def __init__(self, n: int, seq: int = 64) -> None:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.windows = data[: n * seq].view(n, seq)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def build(args: argparse.Namespace, num_samples: int) -> tuple[nn.Module, Dataset]:
    torch.manual_seed(0)  # same initial weights on every rank and in every mode
    if args.model == "mlp":
        return MLP(), Regression(num_samples)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config), HelpText(num_samples)


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Two groups, as real recipes have: no weight decay on biases and norm weights."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


class Progress:
    """Optimizer steps done; checkpointed with the state so a resume knows what to skip."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])


# ------------------------------------------------------------------------------ training
def reduction_bytes(accelerator: Accelerator) -> int:
    """Bytes this rank has sent reducing gradients so far (ZeroAccelerator only, else 0):
    shows that accumulate() skips the reduction on non-final micro-batches."""
    engine = getattr(accelerator, "engine", None)  # after prepare(); plain Accelerate has none
    if engine is None:
        return 0
    sent = engine.comm_bytes()
    return sent.get("reduce_scatter", 0) + sent.get("all_reduce", 0)


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    if args.mode == "ddp":
        # Plain Accelerate needs cpu=True to become distributed in a multi-process CPU launch.
        return Accelerator(gradient_accumulation_steps=args.accum,
                           cpu=not torch.cuda.is_available())
    from zero_strategy.accelerate import ZeroAccelerator, ZeroPlugin

    overrides = {}
    for item in args.zero_opt:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--zero-opt expects KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    plugin = ZeroPlugin.from_config(args.zero_config, **overrides)
    return ZeroAccelerator(gradient_accumulation_steps=args.accum, zero_plugin=plugin)


# ------------------------------------------------------------------------------ fault tolerance
COMPLETE = "COMPLETE"
"""Written into a checkpoint folder once every rank has finished saving it."""


def save_checkpoint(accelerator: Accelerator, root: Path, step: int) -> None:
    """The state after ``step`` into ``root/step-<step>``, marked complete once every rank
    wrote its part; then only the two newest complete checkpoints are kept."""
    folder = root / f"step-{step:08d}"
    accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tmp = folder / f".{COMPLETE}.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, folder / COMPLETE)  # readers see the marker whole or not at all
        for old in sorted(root.glob("step-*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def newest_checkpoint(root: str | None) -> str | None:
    """The newest complete checkpoint under ``root`` (None when there is none)."""
    if root is None or not Path(root).is_dir():
        return None
    complete = [f for f in sorted(Path(root).glob("step-*")) if (f / COMPLETE).is_file()]
    return str(complete[-1]) if complete else None


def injected_fault(accelerator: Accelerator, step: int) -> None:
    """Test seam (tests/quick/test_accelerate.py): ``$ZS_FAULT_KILL_STEP`` / ``$ZS_FAULT_KILL_RANK``
    make that rank SIGKILL itself after that optimizer step, in the first attempt only
    (``$TORCHELASTIC_RESTART_COUNT`` 0), as a lost node would."""
    kill_at = os.environ.get("ZS_FAULT_KILL_STEP")
    if (kill_at is not None and step == int(kill_at)
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and accelerator.process_index == int(os.environ.get("ZS_FAULT_KILL_RANK", "1"))):
        os.kill(os.getpid(), signal.SIGKILL)


def evaluate(accelerator: Accelerator, model: nn.Module, dataset: Dataset, batch: int) -> float:
    """Mean loss over the dataset, all ranks' batches gathered (a data loader prepared alone)."""
    loader = accelerator.prepare(DataLoader(dataset, batch_size=batch))
    model.eval()
    losses = []
    with torch.no_grad():
        for data in loader:
            losses.append(accelerator.gather_for_metrics(model(**data).loss.reshape(1)))
    model.train()
    return torch.cat(losses).mean().item()


def train(args: argparse.Namespace) -> dict[str, Any]:
    accelerator = make_accelerator(args)
    num_samples = args.steps * args.accum * args.batch * accelerator.num_processes
    model, dataset = build(args, num_samples)
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model, args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=args.shuffle)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    resume = args.resume or newest_checkpoint(args.checkpoint_dir)
    if resume:
        accelerator.load_state(resume)
        loader = accelerator.skip_first_batches(loader, progress.steps * args.accum)
    record: dict[str, Any] = {"start_step": progress.steps, "losses": [], "norms": [], "lrs": [],
                              "reduced": [], "skipped": []}
    sent = reduction_bytes(accelerator)

    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        record["losses"].append(loss.item())
        record["reduced"].append(reduction_bytes(accelerator) - sent)
        sent += record["reduced"][-1]
        if accelerator.sync_gradients:
            progress.steps += 1
            record["norms"].append(float(norm))
            record["lrs"].append(scheduler.get_last_lr()[0])
            record["skipped"].append(accelerator.optimizer_step_was_skipped)  # fp16 overflow
            if progress.steps == args.save_at:
                accelerator.save_state(args.save_dir)
            if args.checkpoint_every and progress.steps % args.checkpoint_every == 0:
                save_checkpoint(accelerator, Path(args.checkpoint_dir), progress.steps)
            injected_fault(accelerator, progress.steps)

    record["eval_loss"] = evaluate(accelerator, model, dataset, args.batch)
    record.update(summarize(accelerator, model, initial))
    record["optimizer_state"] = optimizer_digest(optimizer)
    if args.export_dir:
        record["export"] = export(accelerator, model, Path(args.export_dir), args.model)
    record["steps"] = progress.steps
    if accelerator.is_main_process:
        last = record["losses"][-1] if record["losses"] else float("nan")
        accelerator.print(f"{args.mode}: {progress.steps} steps, final loss {last:.4f}")
    return record


def export(accelerator: Accelerator, model: nn.Module, directory: Path,
           kind: str) -> dict[str, Any] | None:
    """The trained model for inference, as Accelerate documents it: ``save_model`` writes
    the consolidated weights as safetensors (under ZeRO a collective: every rank calls it); a
    transformers model's config beside them makes the folder a ``from_pretrained`` one. The
    main process then loads the folder as a consumer would and returns the file names and
    the largest difference from ``get_state_dict`` (0.0: the same weights)."""
    state = accelerator.get_state_dict(model)  # every rank
    accelerator.save_model(model, directory)
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process and hasattr(unwrapped, "config"):
        unwrapped.config.save_pretrained(directory)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return None
    if kind == "gpt2":
        from transformers import GPT2LMHeadModel

        loaded = GPT2LMHeadModel.from_pretrained(directory).state_dict()
    else:
        from safetensors.torch import load_file

        fresh = MLP()
        fresh.load_state_dict(load_file(directory / "model.safetensors"), strict=True)
        loaded = fresh.state_dict()
    worst = max((loaded[k].float() - v.detach().float().cpu()).abs().max().item()
                for k, v in state.items())
    return {"files": sorted(p.name for p in directory.iterdir()), "max_abs_diff": worst,
            "keys_equal": sorted(loaded) == sorted(state)}


def optimizer_digest(optimizer: Any) -> dict[str, dict[str, float]]:
    """Per parameter index and state key, the sum of |state| (no cancellation, so it agrees as
    closely as the elements do) of ``optimizer.state_dict()`` in torch's format (for ZeRO a
    collective that consolidates the shards)."""
    state = optimizer.state_dict()["state"]
    return {str(i): {k: float(v.double().abs().sum()) for k, v in entry.items()}
            for i, entry in state.items()}


def summarize(accelerator: Accelerator, model: nn.Module,
              initial: dict[str, torch.Tensor]) -> dict[str, Any]:
    """How the run was set up, how far the weights moved, and (rank 0) the final weights."""
    state = accelerator.get_state_dict(model)  # on every rank: the ZeRO one is a collective
    state = {k: v.detach().float().cpu() for k, v in state.items()}
    moved = sum((state[k] - v.float()).norm() ** 2 for k, v in initial.items()) ** 0.5
    zero_config = getattr(accelerator, "zero_config", None)
    summary = {
        "rank": accelerator.process_index, "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type), "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        "zero_config": zero_config.to_dict() if zero_config is not None else None,
        "unwrapped": type(accelerator.unwrap_model(model)).__name__,
        "grad_scaler": accelerator.scaler is not None,
        "moved": float(moved / sum(v.float().norm() ** 2 for v in initial.values()) ** 0.5),
    }
    if accelerator.is_main_process:
        summary["weights"] = {k: v.flatten().tolist() for k, v in state.items()}
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    record = train(args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{record['rank']}.json").write_text(json.dumps(record))
    # Shut the group down before the interpreter exits: gloo's threads torn down at exit
    # abort the process ("terminate called without an active exception").
    from zero_strategy.comm.groups import destroy_default_group

    destroy_default_group()


if __name__ == "__main__":
    main()
