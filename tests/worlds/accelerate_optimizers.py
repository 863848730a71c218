"""Muon for the hidden matrices beside AdamW for the rest through ``ZeroAccelerator``, under a
real ``accelerate launch`` of 2 processes; started by tests/quick/test_accelerate.py with the other
launches, ``--out DIR`` gets each rank's ``rank<N>.json``.

``prepare(model, muon, adamw, scheduler)`` at stage 2, a LambdaLR on the Muon part only:
so.STEPS steps (both parts stepped each time) against single-process training
(tests/support/several_optimizers.py); ``save_state``; one more backward with Muon stepped twice
(refused) and AdamW's turn; ``load_state`` back to the saved state, then that step replayed
(AdamW first) to the same weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]

from tests.support import several_optimizers as so  # noqa: E402
from zero_strategy.accelerate import ZeroAccelerator, ZeroPlugin  # noqa: E402
from zero_strategy.comm.groups import destroy_default_group  # noqa: E402


def lrs(*optimizers: Any) -> list[float]:
    return [opt.param_groups[0]["lr"] for opt in optimizers]


def run(out: Path) -> dict[str, Any]:
    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=2, bucket_numel=1000))
    model = so.build()
    muon, adamw = so.optimizers(model)
    model, muon, adamw, sched = accelerator.prepare(model, muon, adamw, so.schedule(muon))
    data = so.rank_batches(accelerator.process_index)
    record: dict[str, Any] = {"rank": accelerator.process_index, "lr": []}
    for batch in data:
        record["lr"].append(lrs(muon, adamw))  # the lr this step uses
        accelerator.backward(so.loss(model, batch))
        muon.step()
        adamw.step()  # its turn: the engine stepped both at muon.step()
        sched.step()
        muon.zero_grad()
        adamw.zero_grad()
    final = accelerator.get_state_dict(model)
    # Accelerate steps a prepared scheduler once per process at every optimizer step.
    ref = so.reference(accelerator.num_processes, sched_calls=accelerator.num_processes)
    record.update(rel=so.rel_diff(final, ref[-1]["weights"]), moved=so.moved(final),
                  engine_steps=accelerator.engine.global_step,
                  part_states=[{i: sorted(s) for i, s in opt.state_dict()["state"].items()}
                               for opt in (muon, adamw)])
    folder = out / "state"
    accelerator.save_state(str(folder))
    accelerator.backward(so.loss(model, data[0]))
    record["double_step"] = so.double_step(lambda: (muon.step(), muon.step()))
    adamw.step()
    stepped = accelerator.get_state_dict(model)
    muon.param_groups[0]["lr"] = 1.0  # load_state must restore the saved lr
    accelerator.load_state(str(folder))
    record["loaded_lr"] = lrs(muon, adamw)
    record["loaded_rel"] = so.rel_diff(accelerator.get_state_dict(model), final)
    accelerator.backward(so.loss(model, data[0]))
    adamw.step()
    muon.step()
    record["replayed_rel"] = so.rel_diff(accelerator.get_state_dict(model), stepped)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    record = run(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{record['rank']}.json").write_text(json.dumps(record))
    destroy_default_group()  # before exit: gloo's threads torn down at exit abort the process


if __name__ == "__main__":
    main()
