"""Peak memory of converting a DeepSpeed checkpoint, ours beside DeepSpeed's ``zero_to_fp32``.

The model is the memory regime of ``bench/compare.py`` (GPT-2, 12 layers, width 1024, vocab
16384: 168 M parameters, the largest tensor the 64 MiB token embedding). DeepSpeed ZeRO-3
trains it one step on 2 CPU ranks and saves (fp32 masters and Adam moments, ~2 GB); then each
conversion runs in its own fresh process, which reports its peak RSS above what it held
after its imports (``ru_maxrss`` before and after):

    python bench/convert_rss.py WORKDIR            # needs the anchors extra (deepspeed)

Printed: the largest tensor, and per conversion the peak above the baseline, for
``zero-strategy convert --to hf`` / ``--to dcp`` / ``consolidate`` and ``zero_to_fp32``
(its default ``.bin`` output). Both tools' imports (torch, deepspeed, transformers' GPT-2) are
made before the baseline: code, not checkpoint data. The HF result is loaded back with
``from_pretrained`` and compared with ``zero_to_fp32``'s weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEMORY_REGIME = {"n_layer": 12, "n_embd": 1024, "n_head": 16, "vocab_size": 16384,
                 "n_positions": 32}


def _config():  # noqa: ANN202
    from transformers import GPT2Config

    return GPT2Config(**MEMORY_REGIME, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      use_cache=False)


def write_checkpoint(out: Path) -> None:
    """Under torchrun: DeepSpeed ZeRO-3, one AdamW step, saved to ``out``."""
    import logging

    import deepspeed
    import torch
    from transformers import GPT2LMHeadModel

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config())
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 3}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    ids = torch.randint(0, MEMORY_REGIME["vocab_size"], (1, 32),
                        generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(str(out))


_MEASURE = """
import resource, sys, runpy
import torch, zero_strategy.cli  # the imports of either tool, before the baseline:
import deepspeed, transformers.models.gpt2.modeling_gpt2  # noqa  (code, not data)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sys.argv = sys.argv[1:]
try:
    if sys.argv[0] == "zero-strategy":
        zero_strategy.cli.main(sys.argv[1:])
    else:
        runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("PEAK_KIB", base, peak, file=sys.stderr)
"""


def measure(args: list[str]) -> tuple[float, float]:
    """(baseline MiB after imports, peak MiB above it) of one conversion in a new process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    run = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True,
                         text=True, env=env)
    line = [ln for ln in run.stderr.splitlines() if ln.startswith("PEAK_KIB")]
    if run.returncode != 0 or not line:
        raise RuntimeError(f"{args}: failed\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    _, base, peak = line[-1].split()
    return int(base) / 1024, (int(peak) - int(base)) / 1024


def main(work: Path) -> dict[str, float]:
    ckpt = work / "ds3"
    if not (ckpt / "latest").exists():
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", __file__, "--write", str(ckpt)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    (work / "config").mkdir(exist_ok=True)
    _config().save_pretrained(work / "config")
    results: dict[str, float] = {"largest_tensor_mib": MEMORY_REGIME["vocab_size"]
                                 * MEMORY_REGIME["n_embd"] * 4 / 2**20}
    for name in ("hf", "dcp", "st", "z2f"):
        for old in (work / name, work / f"{name}.safetensors"):
            subprocess.run(["rm", "-rf", str(old)], check=True)
    runs = {
        "convert_hf": ["zero-strategy", "convert", str(ckpt), str(work / "hf"), "--to", "hf",
                       "--config", str(work / "config")],
        "convert_dcp": ["zero-strategy", "convert", str(ckpt), str(work / "dcp"), "--to", "dcp"],
        "consolidate": ["zero-strategy", "consolidate", str(ckpt), str(work / "st.safetensors")],
        # --safe_serialization fails on GPT-2's tied embedding (safetensors refuses shared
        # tensors), so DeepSpeed's default: torch .bin shards
        "zero_to_fp32": [str(ckpt / "zero_to_fp32.py"), str(ckpt), str(work / "z2f")],
    }
    for name, args in runs.items():
        base, peak = measure(args)
        results[f"{name}_baseline_mib"] = round(base, 1)
        results[f"{name}_peak_above_baseline_mib"] = round(peak, 1)
        print(f"{name:>14}: peak {peak:8.1f} MiB above a baseline of {base:.0f} MiB", flush=True)
    results["hf_equals_zero_to_fp32"] = float(_same_weights(work))
    print(json.dumps(results, indent=1))
    return results


def _same_weights(work: Path) -> bool:
    import torch
    from transformers import GPT2LMHeadModel

    ours = GPT2LMHeadModel.from_pretrained(work / "hf").state_dict()
    theirs: dict[str, torch.Tensor] = {}
    for f in sorted((work / "z2f").glob("*.bin")):
        theirs.update(torch.load(f, weights_only=True))
    return all(torch.equal(ours[k], v) for k, v in theirs.items() if k in ours)


if __name__ == "__main__":
    if sys.argv[1] == "--write":
        write_checkpoint(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
