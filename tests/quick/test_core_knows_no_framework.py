"""``zero_strategy/core`` knows no framework: none of its modules imports transformers,
Lightning, Accelerate, PEFT, TRL or Ray, nor names one of their modules as a string (a
``sys.modules`` lookup, ``importlib.import_module``). A framework's layers reach the core's
activation checkpointing through a ``LayerKind`` its integration registers
(``core/layer_kinds.py``); transformers' is registered by ``import zero_strategy`` without
importing transformers."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero_strategy
from zero_strategy.core import activations
from zero_strategy.core.layer_kinds import layer_kinds

CORE = Path(zero_strategy.__file__).parent / "core"
FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "lightning_fabric",
              "accelerate", "peft", "trl", "ray")
MODULE_NAME = re.compile(rf"^({'|'.join(FRAMEWORKS)})(\.[\w.]*)?$")


def _framework_names(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if MODULE_NAME.match(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module] if MODULE_NAME.match(node.module) else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [node.value] if MODULE_NAME.match(node.value) else []
    return found


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_module_names_no_framework(path: Path) -> None:
    assert _framework_names(path) == [], f"core/{path.name} names a framework"


def test_the_scan_sees_a_lookup_by_string(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("import sys\nlayers = sys.modules.get('transformers.modeling_layers')\n"
                      "from accelerate import Accelerator\n")
    assert sorted(_framework_names(source)) == ["accelerate", "transformers.modeling_layers"]


def test_transformers_layers_are_registered_by_import_zero_strategy() -> None:
    assert [k.description for k in layer_kinds()] == ["transformers GradientCheckpointingLayer"]


def test_import_zero_strategy_imports_no_framework() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys, zero_strategy\n"
         f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_transformers_layers_switch_through_their_own_flag() -> None:
    """Found without ``zero_strategy.transformers``; switched on with the engine's checkpoint
    function and the models' flag (their KV cache off), and all of it undone."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32,
                                     n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    config = zero_strategy.ZeroConfig(activation_checkpointing=True)
    policy = activations.Activations(model, config, device=torch.device("cpu"), rank=0)
    assert policy.modules == list(model.transformer.h)
    policy.install(transfers=None)  # type: ignore[arg-type]  # the device tier moves nothing
    assert all(layer.gradient_checkpointing for layer in model.transformer.h)
    # the engine's checkpoint, labelled with the layer's name for the errors of its input
    for i, layer in enumerate(model.transformer.h):
        func = layer._gradient_checkpointing_func
        assert func.func == policy._labelled
        assert func.args == (f"activation input of module 'transformer.h.{i}'",)
    assert model.transformer.gradient_checkpointing
    policy.remove()
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert not any("_gradient_checkpointing_func" in vars(m) for m in model.transformer.h)
