"""What differs between the torch releases pyproject.toml allows, for tests to branch on by
the declaration in zero_strategy/compat.py (never by whether the name happens to exist, so a
release that should have a name and lost it still fails)."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from zero_strategy import compat

SWAP_SINCE = Version(compat.STORAGE_SWAP.since)
HAS_SWAP_RELEASE = Version(torch.__version__).release >= SWAP_SINCE.release
"""Whether the installed torch is a release that has ``UntypedStorage._swap_data_ptr_``."""

needs_swap = pytest.mark.skipif(
    not HAS_SWAP_RELEASE, reason=f"torch {torch.__version__} predates the storage swap "
    f"({SWAP_SINCE}, compat.STORAGE_SWAP): the buffer pool resizes host memory there, as on a "
    "GPU (test_collectives.py's resize test covers that path)")
