"""A job across nodes, checked by its workers once the process group exists: every node runs
the job's config, and either shares rank 0's job directory or gets its own copy of the metrics.

Each node's Hydra process composed the job from its own command line and wrote its own
``job.yaml``; a node started with a different override (another model size, learning rate)
would join the rendezvous and train something else, so the ranks compare their configs and
refuse naming the keys. Where the job directory is, is a node's own business: the same path
on a shared filesystem (given the same ``hydra.run.dir`` / ``hydra.sweep.dir``), or each
node's own. Rank 0 leaves a file there and every rank looks for it:

- checkpoints (``trainer.checkpoint_every``) are one sharded directory every rank writes into,
  so they need every node to see rank 0's job directory; refused otherwise, naming the keys;
- ``metrics.json`` is written by rank 0, and on every node that does not see it, by that
  node's local rank 0 (the same record, rank 0's), so every node's Hydra process reads the
  job's result (its summary, the value it returns to a sweeper).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from omegaconf import OmegaConf

NODE_LOCAL = ("trainer.preload", "trainer.progress_bar", "trainer.timeout_s")
"""Keys that only steer a node's own Hydra process and may differ between nodes."""


def flat_config(cfg: Any) -> dict[str, Any]:
    """The resolved config as ``{dotted key: value}``, the node-local keys left out."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
            return
        out[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "")
    return {k: v for k, v in out.items() if k not in NODE_LOCAL}


def disagreements(configs: list[dict[str, Any]]) -> list[str]:
    """``key: rank 0 has A, ranks [r, ...] have B`` for every key some rank sees differently."""
    reference, absent = configs[0], "<absent>"
    lines = []
    for key in sorted(set().union(*configs)):
        others: dict[str, list[int]] = {}
        for rank, cfg in enumerate(configs):
            if cfg.get(key, absent) != reference.get(key, absent):
                others.setdefault(repr(cfg.get(key, absent)), []).append(rank)
        lines += [f"{key}: rank 0 has {reference.get(key, absent)!r}, ranks {ranks} have "
                  f"{value}" for value, ranks in others.items()]
    return lines


class NodeAgreement(L.Callback):
    """Installed by worker.py when ``trainer.num_nodes > 1``; its checks raise on every rank
    alike (each decides from the same gathered values), so no rank is left waiting."""

    def __init__(self, cfg: Any, job: Path) -> None:
        self.cfg, self.job = cfg, job
        self.sees_rank0_dir: bool | None = None
        """Whether this rank sees rank 0's job directory (None before ``setup``)."""

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if self.sees_rank0_dir is not None:  # validate() after fit sets up again
            return
        probe = self.job / f".rank0-dir-{uuid.uuid4().hex}" if dist.get_rank() == 0 else None
        if probe is not None:
            probe.touch()
        mine = {"config": flat_config(self.cfg), "probe": probe.name if probe else None,
                "job": str(self.job)}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        self.sees_rank0_dir = (self.job / gathered[0]["probe"]).exists()
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, self.sees_rank0_dir)
        if probe is not None:
            probe.unlink()
        self._refuse([g["config"] for g in gathered], seen, gathered[0]["job"])

    def _refuse(self, configs: list[dict[str, Any]], seen: list[bool], rank0_job: str) -> None:
        differ = disagreements(configs)
        if differ:
            raise ValueError(
                "the nodes of this job were started with different configs (every node must "
                "run the same command; only " + ", ".join(NODE_LOCAL) + " may differ):\n  "
                + "\n  ".join(differ))
        blind = [rank for rank, ok in enumerate(seen) if not ok]
        every = int(self.cfg.trainer.checkpoint_every)
        if blind and every > 0:
            raise ValueError(
                f"trainer.checkpoint_every={every} with trainer.num_nodes="
                f"{self.cfg.trainer.num_nodes}: every rank writes its shards into one "
                f"checkpoint directory under rank 0's job directory {rank0_job}, but ranks "
                f"{blind} do not see it; run every node with the same hydra.run.dir (or "
                "hydra.sweep.dir) on a filesystem they share, or set trainer.checkpoint_every=0 "
                "(no checkpoints: a restarted job starts over)")

    def writes_metrics_copy(self, trainer: L.Trainer) -> bool:
        """This rank writes the job's metrics into its own node's job directory: it is its
        node's local rank 0 and does not see rank 0's (which has rank 0's file)."""
        return (self.sees_rank0_dir is False and trainer.global_rank != 0
                and trainer.local_rank == 0)
