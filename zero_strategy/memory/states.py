"""The ZeRO memory formula for model states, per rank (``report.py`` holds the engine's own
accounting beside it).

Per parameter, with p, g bytes for the compute copy of parameters and gradients and k bytes
of optimizer state (fp32 master included when it is a separate copy), a rank holds
stage 0: p + g + k, stage 1: p + g + k/N, stage 2: p + (g + k)/N, stage 3: (p + g + k)/N.
fp32 Adam: (4, 4, 8); mixed-precision Adam: (2, 2, 12) as in the paper (g is 4 when
gradients are reduced and held in fp32).

Under owner placement (Muon, Adafactor: ``owner.py``) the optimizer states of the placed
parameters are not sharded evenly but held whole by each parameter's owner, so a rank holds
``placed_states`` states for each element it owns instead of ``optimizer_states`` / N for
each placed element; the masters stay sharded as for every parameter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..config import ZeroConfig
from ..core.precision import make_policy
from ..offload.disk import WRITES_IN_FLIGHT, keep_budget


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class MemoryEstimate:
    num_params: int
    stage: int
    world_size: int
    precision: str
    param_bytes_per_param: int
    grad_bytes_per_param: int
    optimizer_bytes_per_param: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    device_bytes: int
    host_bytes: int
    disk_bytes: int = 0
    """Model states resting in the disk tier's files (not resident)."""
    window_bytes: int = 0
    """Disk tier: what streaming holds in memory at once, from the two largest units (u1,
    u2): in the step, one unit's master, states and gradient, the next one's read ahead and
    up to ``WRITES_IN_FLIGHT`` stepped units waiting for write-back,
    ``(u1 + (1 + WRITES_IN_FLIGHT) * u2) * (m + k + g)``; beside it the buffers backward
    used, which the pool keeps for the next step: the gathered first unit and its gradient,
    ``u1 * (p + g)``, and two more units in flight, gathered and reduced, ``2 * u2 * (p +
    g)``; and what the tier keeps for the next phase (``offload.disk.keep_budget``: a
    shard or a gradient of each of the two largest units at the master's size, ``(u1 +
    u2) * m``)."""

    @property
    def resident_bytes(self) -> int:
        """Model-state bytes in memory (device and host): everything but the disk tier's
        files, plus its streaming window."""
        return self.device_bytes + self.host_bytes + self.window_bytes

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def as_dict(self) -> dict[str, int | str]:
        out = asdict(self)
        out["total_bytes"] = self.total_bytes
        out["resident_bytes"] = self.resident_bytes
        return out


def estimate_memory(
    num_params: int, *, stage: int, world_size: int, precision: str = "32-true",
    optimizer_states: int = 2, reduce_dtype: str = "fp32", offload_optimizer: bool | str = False,
    offload_params: bool | str = False, placed_params: int = 0, owned_params: int = 0,
    placed_states: int = 0, elementwise_here: int | None = None, host_is_device: bool = False,
    largest_unit_numels: tuple[int, ...] = (),
) -> MemoryEstimate:
    """Model-state bytes one rank holds under the ZeRO formula (``optimizer_states``: state
    tensors per parameter, 2 for Adam). Offloaded parts count as host bytes.

    ``placed_params`` of the ``num_params`` are trained by an owner-placed optimizer keeping
    ``placed_states`` parameter-sized states (1 for Muon); this rank owns ``owned_params``
    of them. ``elementwise_here``: how many elements of the other parameters lie in this
    rank's shard (flat shards cut across parameters, so with some placed ones the rest need not
    split evenly); by default an even share. ``host_is_device``: training on the CPU, where
    offloading moves nothing (no separate fp32 master, no host bytes apart from the device's).
    ``offload_optimizer="disk"`` puts the optimizer bytes (and the reduced gradients where the
    host is the device) in ``disk_bytes``, ``offload_params="disk"`` the parameter shards;
    ``largest_unit_numels`` (the engine's units' shard sizes) size ``window_bytes``."""
    _check_counts(num_params, world_size, optimizer_states=optimizer_states,
                  placed_states=placed_states, placed_params=placed_params,
                  owned_params=owned_params)
    config = ZeroConfig(  # validates stage/precision/offload combinations with the same rules
        stage=stage, precision=precision, reduce_dtype=reduce_dtype,
        offload_optimizer=offload_optimizer, offload_params=offload_params,
    )
    policy = make_policy(config)
    optimizer_disk = config.optimizer_tier == "disk"
    params_disk = config.params_tier == "disk"
    host_optimizer = config.optimizer_tier == "cpu" and not host_is_device
    host_params = config.params_tier == "cpu" and not host_is_device
    p = _size(policy.compute_dtype)
    g = _size(policy.reduce_dtype)
    separate_master = (policy.separate_master or host_optimizer or host_params
                       or optimizer_disk != params_disk)
    state = _size(policy.master_dtype)
    master = state if separate_master else 0
    k = optimizer_states * state + master
    n = world_size
    shard_p, shard_g, shard_k = stage >= 3, stage >= 2, stage >= 1
    params = num_params * p // (n if shard_p else 1)
    grads = num_params * g // (n if shard_g else 1)
    share = n if shard_k else 1
    if elementwise_here is None:
        elementwise_here = (num_params - placed_params) // share
    optim = (num_params * master // share + elementwise_here * optimizer_states * state
             + owned_params * placed_states * state)
    host = (optim if host_optimizer else 0) + (params if host_params else 0)
    disk_grads = optimizer_disk and host_is_device  # reduced where the master rests
    disk = ((optim if optimizer_disk else 0) + (params if params_disk else 0)
            + (grads if disk_grads else 0))
    params_resident = 0 if params_disk else params
    window = (_disk_window(largest_unit_numels, state, optimizer_states, p, g)
              if optimizer_disk else 0)
    resident = params_resident + (0 if disk_grads else grads) + (0 if optimizer_disk else optim)
    return MemoryEstimate(
        num_params=num_params, stage=stage, world_size=n, precision=precision,
        param_bytes_per_param=p, grad_bytes_per_param=g, optimizer_bytes_per_param=k,
        params_bytes=params, grads_bytes=grads, optimizer_bytes=optim,
        device_bytes=resident - host, host_bytes=host, disk_bytes=disk, window_bytes=window,
    )


def _check_counts(num_params: int, world_size: int, **counts: int) -> None:
    if not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be an int >= 0, got {num_params!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    owned, placed = counts["owned_params"], counts["placed_params"]
    if not owned <= placed <= num_params:
        raise ValueError(f"need owned_params <= placed_params <= num_params, got "
                         f"{owned}, {placed}, {num_params}")


def _disk_window(largest_unit_numels: tuple[int, ...], state: int, optimizer_states: int,
                 p: int, g: int) -> int:
    """Device bytes the disk tier's step streams through at once: the unit stepping and
    those read ahead or written back (``WRITES_IN_FLIGHT``), each with its master, states and
    gradient, the gathered copies of the two largest units, and the kept budget."""
    u1, u2 = ([*sorted(largest_unit_numels, reverse=True), 0, 0])[:2]
    stepping = u1 + (1 + WRITES_IN_FLIGHT) * u2
    return (stepping * (state * (1 + optimizer_states) + g) + (u1 + 2 * u2) * (p + g)
            + keep_budget([u1, u2], state))


def storage_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    """Allocated bytes of the storages behind ``tensors``, each storage counted once."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
