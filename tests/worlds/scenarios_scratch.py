"""A world that leaves files in the temporary directory, as checkpoint and save scenarios do:
tests/quick/test_harness.py checks that the harness removes them with the world."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from tests.support.harness import scenario


@scenario
def leaves_a_file() -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="zs-scratch-")
    Path(folder, "weights.bin").write_bytes(b"\0" * 4096)
    return {"folder": folder, "tempdir": tempfile.gettempdir()}
