"""The six ways a checkpoint gets loaded, as the fuzzer (``tests/support/fuzz.py``) runs them
in a forked child: ``engine.load_checkpoint``, ``zero-strategy consolidate``, ``zero-strategy
convert``, ``zs.convert``, Lightning's ``Trainer.fit(ckpt_path=)`` and
``ZeroAccelerator.load_state``.

Each takes the checkpoint directory and a scratch directory and returns two digests of what
it loaded: ``weights`` (the model's state) and ``full`` (with the optimizer state, step
counters and hyperparameters); or raises what the loader raised. The loaders that hold an
engine set ``untouched`` on the exception: whether the refused load left it as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.support.models import MLP
from tests.worlds.foreign_run import ADAMW, global_batch, loss_fn

Digests = dict[str, str]


def digest(values: dict[str, Any]) -> str:
    """sha256 over sorted keys, each tensor's dtype, shape and bytes, each other value's repr."""
    h = hashlib.sha256()
    for key in sorted(values, key=str):
        value = values[key]
        h.update(str(key).encode())
        if torch.is_tensor(value):
            t = value.detach().contiguous().cpu()
            h.update(f"{t.dtype}{list(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def _reader_digests(path: Path) -> Digests:
    """Everything a checkpoint holds, read back through ``open_reader``."""
    from zero_strategy.checkpoint.read import consolidate, open_reader

    weights = consolidate(path)
    reader = open_reader(path)
    manifest = reader.manifest
    states = {f"{name}/{key}": reader.read_param(name, key)
              for name, record in manifest["param_states"].items()
              for key in record.get("tensors", [])}
    rest = {"scalars": {n: r.get("scalars") for n, r in manifest["param_states"].items()},
            "groups": manifest.get("param_groups"), "engine": manifest["engine"]}
    return {"weights": digest(weights), "full": digest({**weights, **states, **rest})}


# ---------------------------------------------------------------------------- engines
def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(123)  # not the checkpoint's weights: every one must come from the file
    model = MLP()
    return model, torch.optim.AdamW(model.parameters(), **{**ADAMW, "lr": 0.5,
                                                           "weight_decay": 0.0})


def _snapshot(engine: Any) -> str:
    return digest({**engine.full_state_dict(), "lr": engine.user_optimizer.param_groups[0][
        "lr"], "step": engine.global_step})


def _engine_digests(engine: Any) -> Digests:
    """The loaded weights; then, for the optimizer state, the weights after one more step
    (Adam's update reads both moments, the step count and the hyperparameters)."""
    weights = digest(engine.full_state_dict())
    x, y = global_batch(99)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    return {"weights": weights, "full": _snapshot(engine)}


def _load_watched(engine: Any, load: Callable[[], Any]) -> Digests:
    before = _snapshot(engine)
    try:
        load()
    except BaseException as e:
        e.untouched = _snapshot(engine) == before  # type: ignore[attr-defined]
        raise
    return _engine_digests(engine)


def engine(path: Path, scratch: Path) -> Digests:
    import zero_strategy as zs
    from zero_strategy.comm.groups import init_single_process_group

    init_single_process_group(torch.device("cpu"))
    model, opt = _model_and_optimizer()
    eng = zs.ZeroEngine(model, opt, zs.ZeroConfig(stage=2))
    return _load_watched(eng, lambda: eng.load_checkpoint(path))


def accelerate(path: Path, scratch: Path) -> Digests:
    from zero_strategy.accelerate import ZeroAccelerator

    model, opt = _model_and_optimizer()
    accelerator = ZeroAccelerator(project_dir=str(scratch))
    accelerator.prepare(model, opt)
    return _load_watched(accelerator.engine, lambda: accelerator.load_state(str(path)))


def lightning(path: Path, scratch: Path) -> Digests:
    """``Trainer.fit(ckpt_path=)`` on a LightningModule whose parameters are named as the
    checkpoint's (the MLP's layers directly on it)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from zero_strategy.lightning import ZeroStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            model, _ = _model_and_optimizer()
            for name, child in model.named_children():
                self.add_module(name, child)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return MLP.forward(self, x)  # type: ignore[arg-type]

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return loss_fn(self(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), **{**ADAMW, "lr": 0.5})

    x, y = global_batch(99)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=1, max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(scratch))
    module = Module()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=6), ckpt_path=str(path))
    state = {k: v for k, v in trainer.strategy.engine.full_state_dict().items()}
    return {"weights": digest(state), "full": digest({**state, "step": trainer.global_step})}


# ---------------------------------------------------------------------------- files
def consolidate(path: Path, scratch: Path) -> Digests:
    """``zero-strategy consolidate`` to a safetensors file; its error line as a
    CheckpointError (what the command prints is what its user sees)."""
    from safetensors.torch import load_file

    out = scratch / "model.safetensors"
    _cli(["consolidate", str(path), str(out)])
    weights = digest(load_file(str(out)))
    return {"weights": weights, "full": weights}


def convert(path: Path, scratch: Path) -> Digests:
    """``zero-strategy convert --to zero``, read back whole."""
    _cli(["convert", str(path), str(scratch / "zero"), "--to", "zero"])
    return _reader_digests(scratch / "zero")


def zs_convert(path: Path, scratch: Path) -> Digests:
    """``zs.convert(..., "dcp")``, read back whole."""
    import zero_strategy as zs

    zs.convert(path, scratch / "dcp", "dcp")
    return _reader_digests(scratch / "dcp")


def _cli(argv: list[str]) -> None:
    from zero_strategy import CheckpointError, cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(argv)
    if code != 0:
        raise CheckpointError(err.getvalue().strip().removeprefix("error: "))


LOADERS: dict[str, Callable[[Path, Path], Digests]] = {
    "engine": engine, "consolidate": consolidate, "convert": convert,
    "zs_convert": zs_convert, "lightning": lightning, "accelerate": accelerate}
FRAMEWORKS = ("lightning", "accelerate")
"""Loaders that need their framework imported before the children fork (seconds each)."""

__all__ = ["FRAMEWORKS", "LOADERS", "digest"]
