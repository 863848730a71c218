"""How much memory this rank has free right now: the default budget of stage-3 generation.

On a GPU, what the driver reports free (``torch.cuda.mem_get_info``) plus what torch's caching
allocator holds reserved but unused (it hands that out first). On a CPU, the kernel's
``MemAvailable`` (/proc/meminfo), or less when the process's cgroup (v2 ``memory.max`` or v1
``memory.limit_in_bytes``) leaves less room. A margin is kept back either way: the
activations and the key-value cache of the generation itself, and the allocator's slack.
"""

from __future__ import annotations

from pathlib import Path

import torch

MARGIN_FRACTION = 0.25
"""Of the free memory, the part kept back from a generation budget."""


def free_bytes(device: torch.device) -> int:
    """Bytes this process could still allocate on ``device`` (before any margin)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(cached, 0))
    return _host_free()


def generation_budget(device: torch.device) -> int:
    """The default ``ZeroConfig.generation_gather_budget``: free memory less the margin."""
    return int(free_bytes(device) * (1 - MARGIN_FRACTION))


def _host_free() -> int:
    available = _meminfo_available()
    cgroup = _cgroup_room()
    candidates = [v for v in (available, cgroup) if v is not None]
    return min(candidates) if candidates else 0


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """The cgroup's limit less its usage, or None without a limit (or a readable cgroup)."""
    for limit_file, usage_file in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
             "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return max(int(limit) - usage, 0)
    return None
