"""What the engine relies on from torch's private storage operations (``core/storage.py``),
pinned on the installed torch so that a torch that changes them fails here, loudly; and the
two guards built on them: a tensor taken out of ``gathered_parameters()`` is caught before
it can read freed memory, and the runtime's training state moves only as a pass does."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.support.releases import HAS_SWAP_RELEASE, SWAP_SINCE, needs_swap
from zero_strategy.core import storage


def test_the_pool_swaps_host_memory_and_resizes_device_memory() -> None:
    """From the release compat.STORAGE_SWAP names on, host memory must be swapped: a torch
    that drops the swap fails here. Before it, the pool resizes, as on a GPU."""
    assert storage.swaps_memory(torch.device("cpu")) is HAS_SWAP_RELEASE, (
        f"torch {torch.__version__}: UntypedStorage._swap_data_ptr_ present: "
        f"{hasattr(torch.UntypedStorage, '_swap_data_ptr_')}, expected from {SWAP_SINCE} on; "
        "without it the buffer pool falls back to resize_ on host memory: check the pool's "
        "memory figures before accepting that, then move compat.STORAGE_SWAP.since")
    assert not storage.swaps_memory(torch.device("cuda", 0))
    assert not storage.swaps_memory(torch.device("meta"))


@needs_swap
def test_swap_moves_memory_between_storage_objects_that_stay_themselves() -> None:
    unit = torch.arange(6, dtype=torch.float32)
    view = unit[2:4]  # as a parameter views its unit's flat buffer
    block = torch.full((6,), 7.0).untyped_storage()
    empty = torch.empty(0).untyped_storage()
    storage.swap_memory(unit.untyped_storage(), block)
    assert torch.equal(unit, torch.full((6,), 7.0)) and torch.equal(view, torch.full((2,), 7.0))
    assert torch.frombuffer(bytearray(bytes(block)), dtype=torch.float32).tolist() == \
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    storage.swap_memory(empty, unit.untyped_storage())  # reclaim: the unit is left empty
    assert unit.untyped_storage().nbytes() == 0 and empty.nbytes() == 24


@needs_swap
def test_a_tensor_autograd_saved_reads_the_memory_swapped_in() -> None:
    """Stage 3 re-gathers into the storage a forward's saved tensors alias: backward must
    see the new memory through them."""
    x = torch.arange(4, dtype=torch.float32)
    w = torch.ones(4, requires_grad=True)
    loss = (x * w).sum()  # saves x for w's gradient
    storage.swap_memory(x.untyped_storage(), torch.full((4,), 3.0).untyped_storage())
    loss.backward()
    assert torch.equal(w.grad, torch.full((4,), 3.0))


def test_alias_count_counts_views_and_forgets_dead_ones() -> None:
    base = torch.zeros(8)
    start = storage.alias_count(base.untyped_storage())
    assert start is not None, "this torch has no _storage_Use_Count: escaped views go undetected"
    view = base[1:3]
    detached = base.detach()
    assert storage.alias_count(base.untyped_storage()) == start + 2
    del view, detached
    assert storage.alias_count(base.untyped_storage()) == start


ONE_RANK = """
import torch, torch.distributed as dist
import zero_strategy as zs
from zero_strategy.core.runtime import TrainingState
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
engine = zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       zs.ZeroConfig(stage=3, param_persistence_threshold=0, unit_numel=1))
seen = []
model[0].weight.register_hook(lambda g: seen.append(engine.runtime.state) or g)
assert engine.runtime.state is TrainingState.IDLE
loss = engine(torch.randn(2, 8)).sum()
seen.append(engine.runtime.state)
engine.backward(loss)
seen.append(engine.runtime.state)
print("STATES:", ",".join(s.value for s in seen))
engine.step(); engine.zero_grad()

with engine.gathered_parameters(model[0]):
    copy = model[0].weight.detach().clone()     # a copy: fine
with engine.gathered_parameters(model[0]):
    kept = model[0].weight                      # the parameter itself: a placeholder after
print("KEPT_IS_NAN:", bool(torch.isnan(kept).all()))
try:
    with engine.gathered_parameters(model[0]):
        escaped = model[0].weight.detach()      # a view of the gathered buffer
except RuntimeError as e:
    print("ESCAPED:", e)
del escaped

loss = engine(torch.randn(2, 8)).sum()
model[1].weight.register_hook(lambda g: engine.zero_grad() or g)  # a pass abandoned mid-way
try:
    engine.backward(loss)
except RuntimeError as e:
    print("ILLEGAL:", e)
engine.zero_grad()
print("AFTER_RESET:", engine.runtime.state.value)
"""


def test_escaped_views_and_illegal_transitions_are_caught_at_one_rank() -> None:
    result = subprocess.run([sys.executable, "-c", ONE_RANK], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    # The hook on a gradient runs while backward is in progress; the forward left the
    # runtime waiting for its backward; the end-of-backward callback returned it to idle.
    assert out["STATES"] == "pre-backward,backward,idle", out
    assert out["KEPT_IS_NAN"] == "True", out
    assert "taken out of engine.gathered_parameters()" in out["ESCAPED"], out
    assert "p.detach().clone()" in out["ESCAPED"], out
    # zero_grad() from a hook inside backward is refused before it frees anything (the
    # refusal ends that backward; zero_grad() after it returns resets the runtime)
    assert ("runtime of rank 0: reset from state 'backward' is refused; reset starts only "
            "from 'idle', 'pre-backward', 'forward-failed', 'backward-failed'") in out["ILLEGAL"]
    assert "engine.zero_grad() was called during backward" in out["ILLEGAL"], out
    assert out["AFTER_RESET"] == "idle", out
