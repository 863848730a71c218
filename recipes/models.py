"""The recipes' models (transformers classes from configs, random init) and their Lightning
wrapping. The model code holds no parallelism: the strategy applies it."""

from __future__ import annotations

import math
import os
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers.pytorch_utils import Conv1D

import zero_strategy as zs
from recipes import data as recipe_data
from recipes.resume import ResumableSampler

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# name -> size -> architecture knobs
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gpt": {
        "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2},
        "small": {"n_layer": 4, "n_embd": 128, "n_head": 4},
        "base": {"n_layer": 6, "n_embd": 256, "n_head": 8},
        # The regimes of the shared anchor benchmark (conf/experiment/bench_*.yaml).
        "bench_throughput": {"n_layer": 4, "n_embd": 512, "n_head": 8},
        "bench_memory": {"n_layer": 12, "n_embd": 1024, "n_head": 16},
    },
    "bert": {
        "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
                 "intermediate_size": 256},
        "small": {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                  "intermediate_size": 512},
        "base": {"num_hidden_layers": 6, "hidden_size": 256, "num_attention_heads": 8,
                 "intermediate_size": 1024},
    },
    "resnet": {
        "tiny": {"hidden_sizes": [16, 32], "depths": [1, 1], "embedding_size": 16},
        "small": {"hidden_sizes": [32, 64, 128], "depths": [1, 1, 1], "embedding_size": 32},
        "base": {"hidden_sizes": [64, 128, 256, 512], "depths": [2, 2, 2, 2],
                 "embedding_size": 64},
    },
}


def build_model(name: str, size: str, *, vocab_size: int, seq_len: int, dropout: float,
                num_labels: int = 10) -> torch.nn.Module:
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        ResNetConfig,
        ResNetForImageClassification,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if name not in SIZES or size not in SIZES[name]:
        raise ValueError(f"model {name!r} size {size!r}: sizes are {sorted(SIZES.get(name, {}))}")
    knobs = SIZES[name][size]
    if name == "gpt":
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=vocab_size, n_positions=seq_len, resid_pdrop=dropout, embd_pdrop=dropout,
            attn_pdrop=dropout, bos_token_id=2, eos_token_id=3, **knobs))
    if name == "bert":
        return BertForMaskedLM(BertConfig(
            vocab_size=vocab_size, max_position_embeddings=seq_len, pad_token_id=0,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **knobs))
    return ResNetForImageClassification(ResNetConfig(
        num_channels=1, num_labels=num_labels, layer_type="basic", **knobs))


class RecipeModule(L.LightningModule):
    """Any of the recipe models: loss from the model's own head, AdamW, warmup + cosine."""

    def __init__(self, model_cfg: dict[str, Any], optim_cfg: dict[str, Any], vocab_size: int,
                 max_steps: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.kind = model_cfg["name"]
        self.label = f"{model_cfg['name']}-{model_cfg['size']}"  # what was built (the report's)
        self.model = build_model(model_cfg["name"], model_cfg["size"], vocab_size=vocab_size,
                                 seq_len=model_cfg["seq_len"], dropout=model_cfg["dropout"])
        self.built_num_params = sum(p.numel() for p in self.model.parameters())
        """Counted before any strategy shards the parameters (the formula's N_params)."""
        self.adamw_class: type[torch.optim.Optimizer] = torch.optim.AdamW
        """AdamW's implementation (DeepSpeed's offload anchors need their CPU Adam)."""

    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        return self.model(**batch)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        out = self(batch)
        self.log(f"{stage}_loss", out.loss.float(), prog_bar=True, sync_dist=stage == "val")
        if self.kind == "resnet":
            acc = (out.logits.argmax(-1) == batch["labels"]).float().mean()
            self.log(f"{stage}_acc", acc, prog_bar=stage == "val", sync_dist=stage == "val")
        return out.loss

    def training_step(self, batch: dict[str, torch.Tensor], idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> Any:
        cfg, total = self.hparams.optim_cfg, max(1, self.hparams.max_steps)
        opt = build_optimizer(self.model, cfg, adamw_class=self.adamw_class)
        warmup = max(1, int(cfg["warmup_fraction"] * total))

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return cfg["min_lr_ratio"] + (1 - cfg["min_lr_ratio"]) * 0.5 * (
                1 + math.cos(math.pi * progress))

        # One schedule over every group (Muon's and AdamW's alike).
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights of the hidden layers: every Linear / Conv1D weight except the output
    head's (an output projection, tied to the embedding in GPT-2 and BERT, and ResNet's
    classifier are trained by AdamW, as Muon's authors advise)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    classifier = getattr(model, "classifier", None)
    heads = {id(m.weight) for m in (head, classifier) if m is not None and hasattr(m, "weight")}
    for m in (classifier.modules() if classifier is not None else []):
        if hasattr(m, "weight"):
            heads.add(id(m.weight))
    return [m.weight for m in model.modules() if isinstance(m, (nn.Linear, Conv1D))
            and m.weight.ndim == 2 and m.weight.requires_grad and id(m.weight) not in heads]


def build_optimizer(model: nn.Module, cfg: dict[str, Any],
                    adamw_class: type[torch.optim.Optimizer] = torch.optim.AdamW
                    ) -> torch.optim.Optimizer:
    adamw = {"lr": cfg["lr"], "weight_decay": cfg["weight_decay"], "betas": tuple(cfg["betas"])}
    if cfg.get("name", "adamw") == "adamw":
        return adamw_class(model.parameters(), **adamw)
    hidden = hidden_matrices(model)
    if not hidden:
        raise ValueError(
            f"optim.name=muon: {type(model).__name__} has no hidden 2-D weights for Muon (its "
            "convolution filters are 4-D, which torch.optim.Muon does not take); use "
            "optim=adamw")
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return zs.CombinedOptimizer([
        torch.optim.Muon(hidden, lr=cfg["muon_lr"], momentum=cfg["muon_momentum"],
                         weight_decay=cfg["weight_decay"]),
        torch.optim.AdamW(rest, **adamw)])


class RecipeData(L.LightningDataModule):
    def __init__(self, data_cfg: dict[str, Any], model_cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg, self.model_cfg = data_cfg, model_cfg
        self.splits: recipe_data.Splits | None = None
        self.position: tuple[int, int] | None = None
        """(epoch, batches consumed in it) when the last checkpoint was taken."""
        self._resume: tuple[int, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {} if self.position is None else {"position": list(self.position)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, batches = state["position"]
        self._resume = (int(epoch), int(batches))

    @property
    def vocab_size(self) -> int:
        return int(self.cfg.get("vocab_size") or 0)

    def setup(self, stage: str | None = None) -> None:
        if self.splits is not None:
            return
        cfg = self.cfg
        if cfg["kind"] == "digits":
            self.splits = recipe_data.digit_splits(cfg["image_size"], cfg["val_fraction"],
                                                   cfg["seed"])
        elif cfg["kind"] == "random":
            self.splits = recipe_data.random_splits(cfg["vocab_size"], self.model_cfg["seq_len"],
                                                    cfg["samples"], cfg["val_fraction"],
                                                    cfg["seed"])
        else:
            self.splits = recipe_data.text_splits(cfg["kind"], cfg["vocab_size"],
                                                  self.model_cfg["seq_len"], cfg["val_fraction"],
                                                  cfg["seed"])

    def train_dataloader(self) -> DataLoader:
        """Shuffled as Lightning's distributed sampler would (same seed, same order), and
        resumable: after a restart the epoch continues where the checkpoint was taken."""
        assert self.splits is not None and self.trainer is not None
        batch = self.cfg["batch_size"]
        sampler = ResumableSampler(self.splits.train, self.trainer.world_size,
                                   self.trainer.global_rank, seed=self.trainer_seed)
        if self._resume is not None:
            sampler.resume = (self._resume[0], self._resume[1] * batch)
            self._resume = None
        return DataLoader(self.splits.train, batch_size=batch, sampler=sampler, drop_last=True,
                          num_workers=0)

    @property
    def trainer_seed(self) -> int:
        """The seed Lightning gives its own distributed samplers (seed_everything's)."""
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    def val_dataloader(self) -> DataLoader:
        assert self.splits is not None
        return DataLoader(self.splits.val, batch_size=self.cfg["batch_size"], num_workers=0)
