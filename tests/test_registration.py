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


ORDERS = {
    "engine_only": ("import zero_strategy\nassert 'lightning' not in sys.modules", "True"),
    "fabric_first": ("import zero_strategy.fabric", "False"),
    "lightning_first": ("import lightning.pytorch\nimport zero_strategy", "False"),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[int, str, str]]:
    """Each import order in a fresh interpreter, all started at once (each spends ~9 s
    importing Lightning; side by side they share the machine's cores)."""
    procs = {name: subprocess.Popen([sys.executable, "-c", CHECK.format(imports=i, lazy=lazy)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (i, lazy) in ORDERS.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("order", list(ORDERS))
def test_names_registered_in_any_import_order(runs: dict, order: str) -> None:
    code, stdout, stderr = runs[order]
    assert code == 0 and stdout.strip() == "ok", stderr[-2000:]
