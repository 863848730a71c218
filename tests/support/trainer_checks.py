"""What the transformers-integration tests of both tiers share: launching the Trainer runs of
tests/worlds/transformers_run.py under torchrun, and the checks of a ZeRO run against plain
``Trainer`` (DDP) running the same arguments.

Tolerance: every comparison is fp32 on CPU with the same data, seeds and dropout masks on the
same ranks. What differs is the order of a few sums: the engine reduces a flat bucket and
computes the clipping norm from per-shard sums of squares, DDP all-reduces its own buckets and
sums the norm over whole parameters. Each such reordering moves a result by a few ulps
(~1e-7 relative); over 4 AdamW steps, whose update divides by sqrt(v), that grows to ~1e-6 at
worst, so 1e-5 relative (the bound the engine's own parity tests use) holds with margin while
any real error (a lost micro-batch, a skipped clip, a wrong lr) is orders larger.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.worlds.accelerate_launch import launch_environment

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "worlds" / "transformers_run.py"
RTOL = 1e-5


def launch(out: Path, scenarios: list[str], world: int = 2, timeout: float = 600.0,
           script: Path = SCRIPT) -> dict[str, dict[str, Any]]:
    """Run ``scenarios`` of ``script`` (a module whose ``main`` is transformers_run's) in order
    in one torchrun launch of ``world`` CPU processes; {name: rank 0's result} (a failed
    scenario: {"error": traceback})."""
    env = launch_environment({})  # nothing steering Accelerate or the plugin; CPU, gloo
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               str(script), "--out", str(out), "--only", ",".join(scenarios)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    results = {}
    for name in scenarios:
        file = out / f"{name}.json"
        results[name] = (json.loads(file.read_text()) if file.exists() else
                         {"error": f"no result (exit {done.returncode}):\n{done.stderr[-4000:]}"})
    return results


def ok(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in result, result["error"]
    return result


def assert_close_lists(a: list[float], b: list[float], what: str, rtol: float = RTOL) -> None:
    assert len(a) == len(b) and a, f"{what}: {a} vs {b}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * max(abs(x), abs(y), 1e-12), f"{what}[{i}]: {x} vs {y}"


def weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """What ``save_model`` wrote, read back with ``from_pretrained`` as a user would."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def key_bias_apart(key: str, value: torch.Tensor) -> torch.Tensor:
    """GPT-2's attention bias without its key third. The key bias adds q.b_k to every score
    of a query, which softmax cancels: its true gradient is exactly zero, what backward
    computes is rounding noise, and Adam scales noise up to lr-sized steps in whatever
    direction the noise points, differently under any other summation order. Its only
    meaningful check is that it stays where such noise can take it (``assert_key_bias_inert``)."""
    if not key.endswith("attn.c_attn.bias"):
        return value
    width = value.numel() // 3
    return torch.cat([value[:width], value[2 * width:]])


def assert_key_bias_inert(state: dict[str, torch.Tensor], lr: float, steps: int) -> None:
    """Starting at 0, Adam moves each element by at most lr per step."""
    for key, value in state.items():
        if key.endswith("attn.c_attn.bias"):
            width = value.numel() // 3
            assert value[width:2 * width].abs().max().item() <= lr * steps * 1.01, key


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    worst = 0.0
    for key in a:
        x, y = key_bias_apart(key, a[key]).double(), key_bias_apart(key, b[key]).double()
        assert x.shape == y.shape, key
        scale = max(x.abs().max().item(), y.abs().max().item(), 1e-12)
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def assert_matches_ddp(ddp: dict[str, Any], zero: dict[str, Any], name: str) -> float:
    """Every step's loss and gradient norm, the evaluations, the saved model and the
    predictions of a ZeRO run equal plain Trainer's; returns the weights' relative difference."""
    ok(ddp), ok(zero)
    for key in ("loss", "grad_norm", "eval_loss", "lr"):
        assert_close_lists(ddp[key], zero[key], f"{name} {key}")
    assert_close_lists([ddp["test_loss"]], [zero["test_loss"]], f"{name} predict() loss")
    mine = weights(zero["final"])
    diff = max_rel_diff(weights(ddp["final"]), mine)
    assert_key_bias_inert(mine, lr=1e-3, steps=len(zero["loss"]))
    assert diff <= RTOL, f"{name}: saved weights differ from DDP's by {diff:.2e} relative"
    p, q = torch.load(ddp["predictions"]), torch.load(zero["predictions"])
    assert torch.allclose(p, q, rtol=RTOL, atol=RTOL * p.abs().max().item()), name
    return diff


def assert_checkpoint_layout(run: str | Path, world: int = 2) -> None:
    """``checkpoint-N`` as a Trainer user knows it, plus the sharded copy."""
    folder = Path(run) / "checkpoint-2"
    names = {p.name for p in folder.iterdir()}
    expected = {"model.safetensors", "config.json", "zero_checkpoint", "scheduler.pt",
                "trainer_state.json", "training_args.bin",
                *(f"rng_state_{r}.pth" for r in range(world))}
    assert expected <= names, sorted(expected - names)
    assert "optimizer.pt" not in names  # the optimizer lives sharded in zero_checkpoint


def assert_resume_equals_uninterrupted(fit: dict[str, Any], resumed: dict[str, Any],
                                       name: str) -> None:
    """Resumed from checkpoint-2: the last two steps' losses and the final weights are the
    uninterrupted run's, bit for bit (same world, same stage: the same arithmetic)."""
    ok(fit), ok(resumed)
    # The log history up to step 2 comes back from trainer_state.json; steps 3-4 are new.
    assert resumed["loss"][2:] == fit["loss"][2:], (name, resumed["loss"], fit["loss"])
    a, b = weights(fit["final"]), weights(resumed["final"])
    assert all(torch.equal(a[k], b[k]) for k in a), name
