"""The disk tier at set-up: this rank's files, checked against the bytes the ZeRO formula says
it will keep there, and every rank's agreement that all of them can use theirs."""

from __future__ import annotations

import errno
import multiprocessing.util
import weakref

import torch

from ..offload.disk import DiskFullError, DiskTier
from ..optim.combined import parts as optimizer_parts
from ..optim.sharded import placement, states_to_reserve
from .parts import EngineParts


def open_tier(parts: EngineParts, optimizer: torch.optim.Optimizer) -> DiskTier | None:
    """The disk tier's files for this rank (config.offload_dir), after checking that its
    filesystem has the bytes the ZeRO formula says this rank will keep there."""
    config = parts.config
    if config.optimizer_tier != "disk":
        return None
    for part in optimizer_parts(optimizer):
        if placement(part, config.elementwise_optimizer) != "shard":
            raise ValueError(
                f"offload_optimizer='disk' steps optimizers on flat shard pieces, one unit "
                f"at a time; {type(part).__name__} updates whole parameters on owning "
                "ranks: use offload_optimizer='cpu' with it")
    problem: BaseException | None = None
    tier: DiskTier | None = None
    try:
        tier = DiskTier(config.offload_dir, parts.comm.rank)
        tier.check_space(*_disk_bytes(parts, optimizer))
    except (OSError, ValueError) as e:
        problem = e
    agree_on_disk(parts, problem, tier)
    assert tier is not None
    # An engine never closed still removes its directory: when collected, at interpreter
    # exit, and at the exit of a forked worker (multiprocessing skips atexit there).
    weakref.finalize(parts, tier.close)
    multiprocessing.util.Finalize(parts, tier.close, exitpriority=10)
    return tier


def reserve_states(parts: EngineParts) -> None:
    """Disk tier: every optimizer state's file created now, agreed across ranks."""
    if parts.tier is None:
        return
    problem = None
    try:
        parts.optimizer.reserve_states()
    except OSError as e:
        problem = e
    agree_on_disk(parts, problem, parts.tier)


def agree_on_disk(parts: EngineParts, problem: BaseException | None,
                  tier: DiskTier | None) -> None:
    """Every rank raises when one cannot use its offload_dir (the others would wait for
    it in the next collective)."""
    failed = parts.comm.agree_max(int(problem is not None))
    if not failed:
        return
    if tier is not None:
        tier.close()
    if problem is not None:
        raise problem
    raise DiskFullError(errno.EIO, "offload_dir: another rank cannot use its disk tier "
                        "(its error names the directory and the bytes); nothing was built")


def _disk_bytes(parts: EngineParts, optimizer: torch.optim.Optimizer) -> tuple[int, str]:
    policy = parts.plan.policy
    shard = -(-parts.num_params // parts.plan.optimizer_shards)
    states = max((states_to_reserve(part) for part in optimizer_parts(optimizer)),
                 default=0)
    master = policy.master_dtype.itemsize
    total = shard * master * (1 + states)
    what = f"fp32 masters and {states} optimizer state(s) per parameter"
    if parts.device.type == "cpu":
        total += shard * policy.reduce_dtype.itemsize
        what += ", reduced gradients"
    if parts.config.params_tier == "disk" and policy.separate_master:
        total += shard * policy.compute_dtype.itemsize
        what += ", parameter shards"
    return total, what
