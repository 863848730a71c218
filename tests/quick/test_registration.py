"""How the package meets the frameworks it integrates with, in fresh interpreters:

- the Trainer and Fabric strategy names are registered by ``import zero_strategy`` after
  Lightning was imported, by importing an entry point (``zero_strategy.fabric``), or by
  ``zero_strategy.register_strategies()``, with no import hook left in ``sys.meta_path``;
  ``import zero_strategy`` alone does not import Lightning (about 9 s and 110 MiB);
- with Lightning, Accelerate and Hydra absent (hidden by a finder that refuses them, as on a
  ``pip install zero-strategy`` without extras), the engine imports and trains, and each
  framework entry point raises ImportError naming the extra to install.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
hooks_before = list(sys.meta_path)
{imports}
ours = [f for f in sys.meta_path if f not in hooks_before
        and getattr(f, "__module__", "").startswith("zero_strategy")]
assert ours == [], ours  # (Lightning's own imports may add finders of theirs)
import lightning
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
names = ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]
assert all(n in StrategyRegistry for n in names), "Trainer names missing"
assert all(n in STRATEGY_REGISTRY for n in names), "Fabric names missing"
print("ok")
"""

ORDERS = {
    "lightning_first": "import lightning.pytorch\nimport zero_strategy",
    "fabric_entry_point": "import zero_strategy.fabric",
    "explicit_call": ("import zero_strategy\nassert 'lightning' not in sys.modules\n"
                      "import lightning\nzero_strategy.register_strategies()"),
}

# What `pip install zero-strategy` (no extras) leaves out, refused at import as if absent.
WITHOUT_EXTRAS = """
import importlib.abc, sys
ABSENT = ("lightning", "lightning_fabric", "pytorch_lightning", "accelerate", "hydra",
          "omegaconf", "yaml", "transformers")
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
import importlib.util
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in ABSENT else _find(name, package))
"""


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[int, str, str]]:
    """Each import order in a fresh interpreter, all started at once (each spends several
    seconds importing Lightning; side by side they share the machine's cores)."""
    procs = {name: subprocess.Popen([sys.executable, "-c", CHECK.format(imports=imports)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, imports in ORDERS.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("order", list(ORDERS))
def test_names_registered_by_each_documented_route(runs: dict, order: str) -> None:
    code, stdout, stderr = runs[order]
    assert code == 0 and stdout.strip() == "ok", stderr[-2000:]


def _without_extras(body: str) -> subprocess.CompletedProcess:
    script = ("import importlib.util\n_find = importlib.util.find_spec\n"
              + WITHOUT_EXTRAS + body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)


def test_the_engine_needs_no_framework() -> None:
    """One process group of one rank: the engine's step equals plain SGD on the same model
    (a single rank reduces nothing, so the update is bit-identical)."""
    result = _without_extras("""
import copy, sys, torch
import torch.distributed as dist
import zero_strategy as zs
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
reference = copy.deepcopy(model)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
engine = zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       zs.ZeroConfig(stage=3))
x = torch.randn(16, 4)
for _ in range(3):
    engine.backward(engine(x).square().mean()); engine.step(); engine.zero_grad()
    reference(x).square().mean().backward(); ref_opt.step(); ref_opt.zero_grad()
full = engine.full_state_dict()
assert all(torch.equal(full[k], v) for k, v in reference.state_dict().items())
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "accelerate", "hydra"))
assert loaded == [], loaded
print("ok")
""")
    # The last line: gloo of torch 2.9 prints its connection to stdout before it.
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines[-1:] == ["ok"], (result.stdout, result.stderr[-3000:])


@pytest.mark.parametrize("statement, extra", [
    ("import zero_strategy.lightning", "lightning"), ("import zero_strategy.fabric", "lightning"),
    ("import zero_strategy.accelerate", "accelerate"),
    ("zero_strategy.register_strategies()", "lightning")])
def test_a_missing_framework_names_its_extra(statement: str, extra: str) -> None:
    result = _without_extras(f"""
import zero_strategy
try:
    {statement}
except ImportError as e:
    print(e)
""")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'pip install "zero-strategy[{extra}]"' in result.stdout, result.stdout
