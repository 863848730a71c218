"""The gradient stores (``core/grads.py``) driven directly on 2 gloo ranks, against the mean
of every rank's gradient computed apart: each stage's store, several synchronised passes per
step, ``zero`` between steps, hybrid sharding (the sum across replicas), and which gradients
a stage 2-3 store may reduce in place.

The gradients are k/16 with |k| < 16000 (under 2^10): a k/32 has 19 significant bits at
most, so every division by 2, every sum of two and every product by the world size here is
exact in fp32, and each result must equal its float64 reference bit for bit.

Run by tests/quick/test_grad_stores.py; added for the mutants of the mutation run that no
quick test killed (docs/testing.md "Mutation testing").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.support.harness import scenario
from zero_strategy.comm.collectives import Communicator
from zero_strategy.core.buffers import BufferPool
from zero_strategy.core.flat import FlatLayout, make_layout
from zero_strategy.core.grads import GRAD_STORES, GradStore

SHAPES = {"w": (5, 3), "b": (7,)}


def _grads(rank: int, salt: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    return {name: torch.randint(-16_000, 16_000, shape, generator=gen).float() / 16
            for name, shape in SHAPES.items()}


def _mean_flat(layout: FlatLayout, salts: list[int], world: int) -> torch.Tensor:
    """Sum over passes of the mean over ranks, in float64, laid out like the flat buffer."""
    flat = torch.zeros(layout.padded_numel, dtype=torch.float64)
    for salt in salts:
        for rank in range(world):
            for slot, grad in zip(layout.slots, _grads(rank, salt).values(), strict=True):
                flat[slot.offset : slot.end] += grad.double().reshape(-1) / world
    return flat


def _pass(store: GradStore, comm: Any, salt: int) -> list[bool]:
    """One synchronised pass; what ``advance`` answered, polled twice as the runtime polls
    during backward."""
    for index, grad in enumerate(_grads(dist.get_rank(), salt).values()):
        store.accumulate(index, grad)
    store.launch_reduce(comm)
    started = [store.advance(), store.advance()]
    store.finish_reduce()
    return started


class _Done:
    def wait(self, host: bool = False) -> bool:
        return True

    def ready(self) -> bool:
        return True


class _Completing:
    """A shard group whose reductions are complete once launched, as nccl's report
    themselves once the device has run them: ``advance`` then finds the group's reduction in
    and starts the crossing itself, which gloo's (complete only once waited for) never let
    it do."""

    def __init__(self, comm: Communicator) -> None:
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size

    def reduce_scatter(self, out: torch.Tensor, local: torch.Tensor,
                       async_op: bool = False) -> _Done:
        self.comm.reduce_scatter(out, local, async_op=True).wait()
        return _Done()


@scenario
def every_store_reduces_to_the_mean() -> dict[str, Any]:
    """Per store: one pass; two passes in one step (the sum of both means); zero, then one
    pass (that pass alone)."""
    comm, rank, world = Communicator(), dist.get_rank(), dist.get_world_size()
    layout = make_layout([(n, torch.Size(s), 0) for n, s in SHAPES.items()], world)
    out: dict[str, Any] = {}
    for kind, cls in GRAD_STORES.items():
        store = cls(layout, rank, torch.float32, torch.device("cpu"), BufferPool(comm.device))
        lo, hi = ((0, layout.padded_numel) if kind == "all_reduce"
                  else layout.shard_bounds(rank))
        got = []
        for salts in ([1], [1, 2], [3]):
            if salts != [1, 2]:
                store.zero()
            _pass(store, comm, salts[-1])
            ref = _mean_flat(layout, salts, world)[lo:hi].float()
            got.append(torch.equal(store.grad_shard, ref))
        # a pass under no_sync (added locally, never reduced) that the user drops: zero
        # forgets it everywhere in the buffer, not only in the shard
        for index, grad in enumerate(_grads(rank, 9).values()):
            store.accumulate(index, grad)
        store.zero()
        _pass(store, comm, 4)
        got.append(torch.equal(store.grad_shard, _mean_flat(layout, [4], world)[lo:hi].float()))
        out[kind] = got
    return out


@scenario
def hybrid_stores_sum_across_replicas() -> dict[str, Any]:
    """Shard groups of one rank, the replica group of both: each shard is the world's mean
    in every pass of a step and after ``zero``, the crossing started by ``finish_reduce``
    (gloo) or by ``advance`` (a group whose reduction completes at once). ``advance`` says
    whether the crossing has started: not while the group's reduction is out, and always
    where there is none to start (no replicas)."""
    comm, world = Communicator(), dist.get_world_size()
    shards, replicas = comm.split(1)
    layout = make_layout([(n, torch.Size(s), 0) for n, s in SHAPES.items()], 1)
    out: dict[str, Any] = {}
    for kind in ("reduce_scatter_full", "reduce_scatter_sharded"):
        for group in (shards, _Completing(shards)):
            store = GRAD_STORES[kind](layout, shards.rank, torch.float32, torch.device("cpu"),
                                      BufferPool(comm.device), replicas=replicas)
            got, started = [], []
            for salts in ([1], [1, 2], [3]):
                if salts != [1, 2]:
                    store.zero()
                started += _pass(store, group, salts[-1])
                ref = _mean_flat(layout, salts, world).float()
                got.append(torch.equal(store.grad_shard, ref))
            name = "completing" if isinstance(group, _Completing) else "gloo"
            out[f"{kind}_{name}"] = {"mean": got, "started": started}
        alone = GRAD_STORES[kind](layout, 0, torch.float32, torch.device("cpu"),
                                  BufferPool(comm.device))
        out[f"{kind}_no_replicas"] = {"started": _pass(alone, shards, 1)}
    return out


@scenario
def a_pass_cut_short_is_not_crossed() -> dict[str, Any]:
    """Hybrid sharding, a pass cut short at different points on the two replicas (rank 0
    launched the unit's reduction, rank 1 failed before): ``zero`` drops rank 0's without
    crossing it, a collective rank 1 never joins (it would pair with rank 1's next one, or
    time out). The next pass is the world's mean on both."""
    comm, rank, world = Communicator(timeout=20), dist.get_rank(), dist.get_world_size()
    shards, replicas = comm.split(1)
    layout = make_layout([(n, torch.Size(s), 0) for n, s in SHAPES.items()], 1)
    store = GRAD_STORES["reduce_scatter_sharded"](layout, 0, torch.float32,
                                                   torch.device("cpu"),
                                                   BufferPool(comm.device), replicas=replicas)
    for index, grad in enumerate(_grads(rank, 9).values()):
        store.accumulate(index, grad)
    if rank == 0:
        store.launch_reduce(shards)
    store.zero()
    _pass(store, shards, 3)
    return {"mean": torch.equal(store.grad_shard, _mean_flat(layout, [3], world).float())}


@scenario
def sharded_store_reduces_in_place_only_what_it_owns() -> dict[str, Any]:
    """A one-parameter unit that fills its buffer exactly (adoptable): a gradient alone in
    its storage is reduced where it lies, into the shard (no pool memory taken); a view of a
    caller's tensor is copied, and the caller's tensor keeps its values. Both reduce to the
    mean, in two steps."""
    comm, rank, world = Communicator(), dist.get_rank(), dist.get_world_size()
    numel = 8 * world
    layout = make_layout([("w", torch.Size((numel,)), 0)], world, shard_align=1)
    lo, hi = layout.shard_bounds(rank)
    ref = sum(_values(r, numel) for r in range(world)) / world
    out: dict[str, Any] = {}
    for case in ("alone", "view"):
        pool = BufferPool(comm.device)
        store = GRAD_STORES["reduce_scatter_sharded"](layout, rank, torch.float32,
                                                       torch.device("cpu"), pool)
        base = _values(rank, numel).reshape(2, -1)
        # a view of the whole of ``base`` (offset 0, every byte): only its being a view
        # tells it apart from a gradient alone in its storage
        means, pool_bytes = [], []
        for step in range(2):  # the first reduction of a new store, or after zero, is in place
            if step:
                store.zero()
            grad = _values(rank, numel) if case == "alone" else base.view(-1)
            store.accumulate(0, grad)
            store.launch_reduce(comm)
            store.finish_reduce()
            means.append(torch.equal(store.grad_shard, ref[lo:hi]))
            pool_bytes.append(pool.held_bytes())
        out[case] = {"mean": means, "pool_bytes": pool_bytes,
                     "caller_kept": torch.equal(base.reshape(-1), _values(rank, numel))}
    out["buffer_bytes"] = layout.padded_numel * 4
    return out


def _values(rank: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 + rank)
    return torch.randint(-16_000, 16_000, (numel,), generator=gen).float() / 16


@scenario
def zero_after_a_cut_short_reduction() -> dict[str, Any]:
    """A pass cut short with its reduction still out (an error in backward): ``zero`` waits
    for it, gives its output back to the pool when that is pool memory (a second pass's),
    and never when it is the shard itself (the first pass reduces straight into it): a
    shard in the pool would be lent to the next buffer while it still holds gradients."""
    comm, rank = Communicator(), dist.get_rank()
    layout = make_layout([(n, torch.Size(s), 0) for n, s in SHAPES.items()], 2)
    shard_bytes = layout.shard_numel * 4
    out: dict[str, Any] = {}
    for case in ("first_pass", "second_pass"):
        pool = BufferPool(comm.device)
        store = GRAD_STORES["reduce_scatter_sharded"](layout, rank, torch.float32,
                                                       torch.device("cpu"), pool)
        if case == "second_pass":
            _pass(store, comm, 1)  # reduced into the shard: the next one goes through the pool
        for index, grad in enumerate(_grads(rank, 2).values()):
            store.accumulate(index, grad)
        store.launch_reduce(comm)
        store.zero()  # no finish_reduce: the pass was cut short
        shard = store.grad_shard.untyped_storage().data_ptr()
        blocks = [b for free in pool._free.values() for b in free]
        out[case] = {"shard_in_pool": any(b.data_ptr() == shard for b in blocks),
                     "shard_sized_blocks": len(pool._free.get(shard_bytes, [])),
                     "zeros": not store.grad_shard.any().item()}
    return out
