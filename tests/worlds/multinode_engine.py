"""One rank of the engine trained across nodes: run by tests/integration/test_multinode.py under two
``torch.distributed.run`` agents (``--nnodes 2 --rdzv-backend c10d``), as a user's script would
be under torchrun on two machines.

Every rank draws the whole global batch from one seeded generator and trains on its own
quarter, so the test can train one process on the whole batch and compare. It trains twice:
sharded over all 4 ranks, then with hybrid sharding (``shard_group_size=2``: each node a
group, only gradient shards crossing between the nodes). Each rank writes
``rank<N><suffix>.json`` (where it ran, losses, gradient norms, bytes sent); rank 0 also
writes the final consolidated weights (``weights<suffix>.pt``); the suffix is "" for the
first run, "-hybrid" for the second.

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT --rdzv-id JOB tests/worlds/multinode_engine.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import zero_strategy as zs  # noqa: E402
from tests.support.models import batch, loss_of, make_model, make_optimizer, zero_config  # noqa: E402

STEPS, PER_RANK, CLIP, SEED = 6, 4, 0.5, 1234


def global_batches(world: int) -> list[dict[str, torch.Tensor]]:
    """The global batch of every step, the same on every rank and in the reference."""
    gen = torch.Generator().manual_seed(SEED)
    return [batch("mlp", gen, size=PER_RANK * world) for _ in range(STEPS)]


def my_part(data: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * PER_RANK:(rank + 1) * PER_RANK] for k, v in data.items()}


RUNS = {"": {}, "-hybrid": {"shard_group_size": 2}}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for suffix, extra in RUNS.items():
        train(out, suffix, extra)
    dist.barrier()
    dist.destroy_process_group()


def train(out: Path, suffix: str, extra: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("mlp")
    engine = zs.ZeroEngine(model, make_optimizer("sgd", model), zero_config("mlp", 3, **extra))
    record: dict = {"rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"]),
                    "group_rank": int(os.environ["GROUP_RANK"]), "losses": [], "norms": [],
                    "sent": []}
    for data in global_batches(world):
        before = engine.comm_bytes()
        loss = loss_of("mlp", engine, my_part(data, rank))
        engine.backward(loss)
        record["norms"].append(engine.clip_grad_norm_(CLIP).item())
        engine.step()
        after = engine.comm_bytes()
        record["sent"].append({k: after[k] - before.get(k, 0) for k in after})
        record["losses"].append(loss.item())
    record["num_params"] = engine.num_params
    record["shard_numel"] = sum(u.layout.shard_numel for u in engine.units)
    kept = [u for u in engine.units if u.index in engine.runtime._kept]
    record["kept"] = {"units": len(kept), "numel": sum(u.layout.padded_numel for u in kept)}
    full = engine.full_state_dict()  # a collective: every rank
    if rank == 0:
        torch.save(full, out / f"weights{suffix}.pt")
    (out / f"rank{rank}{suffix}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
