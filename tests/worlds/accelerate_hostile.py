"""Hostile files in an Accelerate state folder, against ``ZeroAccelerator.load_state``.

Run by tests/quick/test_checkpoint_faults.py as one plain process (a world of one, no launcher):
``python tests/worlds/accelerate_hostile.py WORK_DIR`` writes ``WORK_DIR/result.json``. A good state
is saved, training goes on one more step, then each hostile folder must be refused with the
weights, step, learning rate and registered object unchanged and no payload run.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.support.hostile import edit_manifest, payload_bytes, refresh
from tests.support.models import MLP
from zero_strategy.accelerate import ZeroAccelerator, ZeroPlugin

ZERO = Path("zero_checkpoint")


class Counter:
    """A registered object (saved by Accelerate as custom_checkpoint_0.pkl)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = int(state["n"])


def _link(path: Path, target: Path | str) -> None:
    path.unlink()
    path.symlink_to(target)


def _payload(file: Path, marker: Path, refresh_manifest: bool = False) -> None:
    file.write_bytes(payload_bytes(marker))
    if refresh_manifest:
        refresh(file.parent, file.name)


# name -> (edit(folder, outside, marker), expected text)
VARIANTS: dict[str, tuple[Callable[[Path, Path, Path], Any], str]] = {
    "custom_payload": (lambda f, o, m: _payload(f / "custom_checkpoint_0.pkl", m),
                       "cannot be unpickled with weights_only=True"),
    "custom_symlink": (lambda f, o, m: _link(f / "custom_checkpoint_0.pkl",
                                             o / "custom_checkpoint_0.pkl"),
                       "outside the checkpoint directory"),
    "rng_dev_zero": (lambda f, o, m: _link(f / "random_states_0.pkl", "/dev/zero"),
                     "outside the checkpoint directory"),
    "zero_latest_traversal": (lambda f, o, m: (f / ZERO / "latest").write_text(
        f"../../{o.name}/{ZERO}/state"), "is not a plain file or directory name"),
    "zero_manifest_forged": (lambda f, o, m: edit_manifest(f / ZERO / "state",
                                                           lambda x: x.pop("units")),
                             "field 'units' is missing"),
    "zero_client_payload": (lambda f, o, m: _payload(f / ZERO / "state" / "client_state.pt", m,
                                                     refresh_manifest=True),
                            "cannot be loaded with weights_only=True"),
}


def main(work: Path) -> None:
    torch.manual_seed(0)
    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(
        stage=3, unit_numel=500, param_persistence_threshold=40))
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step() -> None:
        loss = model(torch.randn(4, 16)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        counter.n += 1

    def snapshot() -> dict[str, Any]:
        weights = accelerator.get_state_dict(model)
        return {"weights": {k: v.tolist() for k, v in weights.items()},
                "step": accelerator.engine.global_step, "n": counter.n,
                "lr": [g["lr"] for g in optimizer.param_groups]}

    step()
    accelerator.save_state(str(work / "good"))
    shutil.copytree(work / "good", work / "outside")
    step()
    before = snapshot()
    out: dict[str, Any] = {}
    for name, (edit, expect) in VARIANTS.items():
        folder, marker = work / name, work / f"{name}.marker"
        shutil.copytree(work / "good", folder, symlinks=True)
        edit(folder, work / "outside", marker)
        try:
            accelerator.load_state(str(folder))
            error = None
        except Exception as e:  # the test asserts on the type and text
            error = f"{type(e).__name__}: {e}"
        out[name] = {"error": error, "expect": expect, "untouched": snapshot() == before,
                     "marker": marker.exists()}
    accelerator.load_state(str(work / "good"))  # the control
    after = snapshot()
    out["_control"] = {"step": after["step"], "n": after["n"], "changed": after != before}
    (work / "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
