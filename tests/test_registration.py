"""`import zero_strategy` registers the Lightning and Fabric strategy names in any import order,
without importing Lightning itself (engine-only users do not pay for it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
{imports}
assert {lazy} or "lightning" in sys.modules
import lightning
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
names = ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]
assert all(n in StrategyRegistry for n in names), "Trainer names missing"
assert all(n in STRATEGY_REGISTRY for n in names), "Fabric names missing"
print("ok")
"""


@pytest.mark.parametrize(("imports", "lazy"), [
    ("import zero_strategy\nassert 'lightning' not in sys.modules", "True"),
    ("import zero_strategy.fabric", "False"),
    ("import lightning.pytorch\nimport zero_strategy", "False"),
])
def test_names_registered_in_any_import_order(imports: str, lazy: str) -> None:
    run = subprocess.run([sys.executable, "-c", CHECK.format(imports=imports, lazy=lazy)],
                         capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
