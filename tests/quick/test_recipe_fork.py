"""The recipes fork their workers from the preloaded Hydra process (``trainer.preload=true``);
a process holding a CUDA context cannot hand it to a forked child, so the launch refuses,
naming what initialised CUDA and the ``trainer.preload=false`` way out. CUDA cannot be
initialised on this CPU machine: ``torch.cuda.is_initialized`` is replaced by a shim that
reports True from the start, or once a given module has been imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, torch
from recipes import agent
data_cfg, model_cfg = {"kind": "causal", "vocab_size": 512}, {"name": "gpt"}

def refusal():
    try:
        agent.preload(data_cfg, model_cfg)
    except RuntimeError as e:
        return str(e)
    return "no refusal"

torch.cuda.is_initialized = lambda: True
print("FROM_START:", refusal())
torch.cuda.is_initialized = lambda: "transformers" in sys.modules
print("ON_IMPORT:", refusal())
"""


def test_forking_after_cuda_was_initialised_is_refused_naming_the_cause() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert "before this job was preloaded" in lines["FROM_START"], lines
    assert "importing transformers" in lines["ON_IMPORT"], lines
    for message in lines.values():
        assert "trainer.preload=false" in message, message
