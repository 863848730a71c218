"""Mixture-of-experts Trainer runs for tests/integration/test_moe_training.py, launched like
tests/worlds/transformers_run.py (whose ``main`` runs them): ``python -m torch.distributed.run
--nproc_per_node 2 this.py --out DIR --only a,b``.

Each scenario trains a tiny Qwen3-MoE or Mixtral, built from its config, written with
``save_pretrained`` and read back with the model class's own ``from_pretrained`` (so the
weights are what a real checkpoint holds after transformers' conversions), under plain
``Trainer`` (DDP) or ``ZeroTrainer`` at stage 2, 3 and 3 with CPU offload. Each rank reads
tokens from its own half of the vocabulary, so the ranks route to different experts: a hook
on every router counts the tokens each expert received on each rank, and the result carries
those counts so the test can assert that some expert went without tokens on one rank while
another rank used it.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script by torchrun
    sys.path.insert(0, str(ROOT))

from tests.support.moe_configs import VOCAB, config, count_routes  # noqa: E402
from tests.worlds import transformers_run as T  # noqa: E402
from zero_strategy.transformers import ZeroPlugin, ZeroTrainer, with_zero  # noqa: E402

STEPS = 3
MODES: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "z2": {"stage": 2},
    # unit_numel=1: every module its own unit (the fused experts, the router, each
    # projection); threshold 0: every parameter sharded, none kept whole.
    "z3": {"stage": 3, "param_persistence_threshold": 0, "unit_numel": 1},
    "z3off": {"stage": 3, "param_persistence_threshold": 0, "unit_numel": 1,
              "offload_optimizer": True, "offload_params": True},
}


def pretrained(family: str, out: Path, experts: str | None = None) -> torch.nn.Module:
    """The model as a user loads a checkpoint: written once by rank 0 (``save_pretrained``
    writes on rank 0 only once a process group exists) and loaded back by every rank."""
    from transformers import AutoModelForCausalLM

    if not dist.is_initialized():  # Accelerate takes the group over as it finds it
        dist.init_process_group("gloo")
    folder = out / f"pretrained_{family}"
    if dist.get_rank() == 0 and not folder.exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config(family)).save_pretrained(folder)
    dist.barrier()
    cls = type(AutoModelForCausalLM.from_config(config(family)))
    # experts: transformers' experts implementation (None: its default, grouped_mm).
    return cls.from_pretrained(folder, experts_implementation=experts)


class RankTokens(Dataset):
    """Rows drawn from the reading rank's half of the vocabulary: the ranks' hidden states,
    hence their routing, differ."""

    def __init__(self, n: int = 64, seq: int = 8) -> None:
        self.n, self.seq = n, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        half = VOCAB // 2
        g = torch.Generator().manual_seed(1000 * rank + i)
        row = torch.randint(rank * half, (rank + 1) * half, (self.seq,), generator=g)
        return {"input_ids": row, "labels": row}


def _moe(family: str, mode: str, out: Path, experts: str | None = None) -> dict[str, Any]:
    run = out / f"{family}_{experts or 'default'}_{mode}"
    model = pretrained(family, out, experts)
    routes = count_routes(model)
    kwargs = dict(model=model, train_dataset=RankTokens(),
                  args=T.arguments(run, per_device_train_batch_size=2, max_steps=STEPS,
                                   gradient_accumulation_steps=2, learning_rate=1e-2,
                                   warmup_steps=0, max_grad_norm=1.0))
    options = MODES[mode]
    # z3off through with_zero(Trainer), the others through ZeroTrainer: both entry points.
    zero_class = with_zero(T.Trainer) if mode == "z3off" else ZeroTrainer
    trainer = (T.Trainer(**kwargs) if options is None else
               zero_class(zero_plugin=ZeroPlugin(**options), **kwargs))
    trainer.train()
    trainer.save_model(str(run / "final"))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, routes)
    return {**T.history(trainer), "final": str(run / "final"), "routes": every,
            "pretrained": str(out / f"pretrained_{family}"),
            "experts_implementation": model.config._experts_implementation}


for _family in ("qwen3moe", "mixtral"):
    for _mode in MODES:
        T.SCENARIOS[f"{_family}_{_mode}"] = functools.partial(_moe, _family, _mode)
# The experts' per-expert loop (transformers' "eager" experts: each hit expert's slice of the
# 3-D weights indexed) beside the default grouped matmul.
for _mode in ("ddp", "z3"):
    T.SCENARIOS[f"mixtral_eager_{_mode}"] = functools.partial(_moe, "mixtral", _mode,
                                                             experts="eager")


if __name__ == "__main__":
    T.main()
