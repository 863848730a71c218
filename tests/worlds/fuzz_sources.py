"""The fuzzer's starting points (``tests/support/fuzz.py``), written by the real writers in
one 2-rank launch, so the anchors' start-up is paid once:

- ``<out>/ds3``, ``<out>/ds2``: DeepSpeed ZeRO-3 and ZeRO-2 (``engine.save_checkpoint``, tag
  ``global_step2``);
- ``<out>/dcp``: FSDP2's ``dcp.save`` of ``get_state_dict(model, optimizer)``;
- ``<out>/ours``: our engine at stage 3 (tag ``t``, with a client state), the layout
  ``tests/support/hostile.py`` forges.

Each trains ``tests.support.models.MLP`` with AdamW for ``STEPS`` steps on the data of
``foreign_run.py``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/worlds/fuzz_sources.py OUT [ds3,ds2,dcp,ours]
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.worlds.foreign_run import ADAMW, ROWS, _Plain, global_batch, local, loss_fn, make_model

STEPS = 2


def _train(engine: object) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        x, y = global_batch(step)
        loss = loss_fn(engine(local(x, rank, world)), local(y, rank, world))  # type: ignore
        engine.backward(loss)  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]


def _deepspeed(out: Path, stage: int) -> None:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dist.get_world_size(),
        "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]),
                                                  "torch_adam": True}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    _train(engine)
    engine.save_checkpoint(str(out), client_state={"data_step": STEPS})
    engine.destroy()


def _fsdp2(out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    _train(_Plain(model, opt))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd, "train_state": {"data_step": STEPS}},
             checkpoint_id=str(out))


def _ours(out: Path) -> None:
    import zero_strategy as zs

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    engine = zs.ZeroEngine(model, opt, zs.ZeroConfig(stage=3))
    _train(engine)
    engine.save_checkpoint(out, tag="t", client_state={"epoch": 1})


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ds3", "ds2", "dcp", "ours"]
    if "ds3" in kinds or "ds2" in kinds:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    for kind, write in (("ds3", lambda o: _deepspeed(o, 3)), ("ds2", lambda o: _deepspeed(o, 2)),
                        ("dcp", _fsdp2), ("ours", _ours)):
        if kind in kinds:
            write(out / kind)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
