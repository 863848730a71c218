"""The sweep report: one row per job of a multirun, as markdown, CSV and a PNG.

Registered as a Hydra callback in conf/config.yaml, so ``python recipes/train.py -m ...``
writes ``report.md``, ``report.csv`` and ``report.png`` into the sweep directory. Also usable
alone: ``python recipes/report.py multirun/2026-11-21_12-00-00``.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = [
    ("strategy", "strategy", "{}"), ("optim", "optimizer", "{}"), ("model", "model", "{}"),
    ("precision", "precision", "{}"), ("world_size", "N", "{}"),
    ("ms_per_batch", "ms/batch", "{:.0f}"), ("samples_per_s", "samples/s", "{:.1f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"), ("peak_rss_mib", "peak RSS MiB/rank", "{:.0f}"),
    ("model_state_mib", "model states MiB/rank", "{:.2f}"),
    ("predicted_mib", "ZeRO formula MiB/rank", "{:.2f}"),
    ("activation_mib", "activations MiB/rank", "{:.2f}"),
    ("predicted_activation_mib", "activation formula MiB/rank", "{:.2f}"),
    ("comm_mib_per_step", "MiB sent/step/rank", "{:.2f}"), ("first_loss", "first loss", "{:.3f}"),
    ("train_loss", "final train loss", "{:.3f}"), ("val_loss", "val loss", "{:.3f}"),
]


def _max_mib(ranks: list[dict[str, Any]], key: str) -> float | None:
    """The largest figure over ranks in MiB; None where no rank recorded one (a run from
    before the field, or one the engine or the formula does not measure)."""
    values = [r[key] for r in ranks if r.get(key) is not None]
    return max(values) / 2.0**20 if values else None


def rows(sweep_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(sweep_dir.glob("*/metrics.json"), key=lambda p: p.parent.name):
        m = json.loads(path.read_text())
        mib = 2.0**20
        out.append({
            **{k: m.get(k) for k, _, _ in COLUMNS if k in m},
            "peak_rss_mib": max(r["peak_rss_mib"] for r in m["ranks"]),
            "model_state_mib": max(r["model_state_bytes"] for r in m["ranks"]) / mib,
            "predicted_mib": max(r["predicted_bytes"] for r in m["ranks"]) / mib,
            "activation_mib": _max_mib(m["ranks"], "activation_bytes"),
            "predicted_activation_mib": _max_mib(m["ranks"], "predicted_activation_bytes"),
            "comm_mib_per_step": (m["comm_bytes_per_step"] / mib
                                  if m.get("comm_bytes_per_step") is not None else None),
            "val_acc": m.get("val_acc"), "job": path.parent.name,
            "zero_options": m.get("zero_options"),
            "requested": m.get("requested", {}),
            "nodes": m.get("nodes", 1), "launcher": m.get("launcher"),
        })
    return out


NOT_MEASURED = "not measured"


def cell(row: dict[str, Any], key: str, fmt: str) -> str:
    """A value as the table shows it; bytes sent that the system did not let us count say
    so (a blank or a 0 would read as "sent nothing")."""
    value = row.get(key)
    if value is None:
        return NOT_MEASURED if key == "comm_mib_per_step" else ""
    return fmt.format(value)


def changed_by_the_run(row: dict[str, Any]) -> list[str]:
    """What the job ran differently from what its config asked for (the columns show what
    ran), e.g. Lightning running ``16-mixed`` as ``bf16-mixed`` on a CPU."""
    return [f"{key} requested {asked!r}, ran {row.get(key)!r}"
            for key, asked in row.get("requested", {}).items() if row.get(key) != asked]


OPTIONS = ("zero_options", "zero options", "{}")


def columns(table: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The report's columns; the engine options that differ from the defaults get one when
    some job changed any (a sweep over ``strategy.zero.*`` would otherwise show rows that
    look alike)."""
    changed = any(r.get("zero_options") not in (None, "defaults") for r in table)
    return COLUMNS[:1] + [OPTIONS] + COLUMNS[1:] if changed else COLUMNS


def write(sweep_dir: Path) -> list[Path]:
    table = rows(sweep_dir)
    if not table:
        return []
    shown = columns(table)
    keys = [k for k, _, _ in COLUMNS] + ["val_acc", "job", "zero_options"]
    with open(sweep_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows({k: r.get(k) for k in keys} for r in table)
    head = "| " + " | ".join(h for _, h, _ in shown) + " |"
    lines = [f"# Sweep report: {sweep_dir}", "", head,
             "|" + "---|" * len(shown)]
    for r in table:
        lines.append("| " + " | ".join(cell(r, k, fmt) for k, _, fmt in shown) + " |")
    changes = [f"- {r['job']}: {', '.join(c)}" for r in table if (c := changed_by_the_run(r))]
    if changes:
        lines += ["", "Jobs that did not run as requested (the table shows what ran):", *changes]
    lines += ["", "Strategy, precision and N are read from each run's Trainer and engine. "
              "Throughput is measured after 3 warm-up steps; peak RSS is the growth of each "
              "rank's resident memory during training (max over ranks); model states are the "
              "bytes of parameters, gradients and optimizer states one rank holds, beside the "
              "ZeRO formula's prediction (ours: the engine's accounting; DDP, FSDP, DeepSpeed: "
              "a census of the tensors they hold after backward, before the optimizer step, "
              "in the last warm-up step); activations are the bytes one rank's forward leaves "
              "for backward (measured by the engine where it does), beside the activation "
              "formula (zs.estimate_activations: the model, micro-batch, sequence or image "
              "size, precision and activation checkpointing; blank under autocast); bytes sent "
              "count every collective of one rank "
              "during training steps (validation and checkpoints left out): the engine's own "
              "counter for ours, the process-group counter (recipes/comm_count.py) for the "
              "others, 'not measured' where that counter saw nothing; the val loss is the "
              "final model's."]
    (sweep_dir / "report.md").write_text("\n".join(lines) + "\n")
    return [sweep_dir / "report.md", sweep_dir / "report.csv", plot(table, sweep_dir)]


def plot(table: list[dict[str, Any]], sweep_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["strategy"] or r["job"] for r in table]
    x = range(len(table))
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    axes[0].bar(x, [r["samples_per_s"] for r in table], color="tab:blue")
    axes[0].set_title("throughput (samples/s)")
    width = 0.4
    axes[1].bar([i - width / 2 for i in x], [r["model_state_mib"] for r in table], width,
                label="measured")
    axes[1].bar([i + width / 2 for i in x], [r["predicted_mib"] for r in table], width,
                label="ZeRO formula")
    axes[1].set_title("model states per rank (MiB)")
    axes[1].legend()
    sent = [r["comm_mib_per_step"] for r in table]
    axes[2].bar(x, [v if v is not None else 0.0 for v in sent], color="tab:orange")
    for i, v in enumerate(sent):
        if v is None:
            axes[2].text(i, 0, NOT_MEASURED, rotation=90, ha="center", va="bottom")
    axes[2].set_title("sent per step per rank (MiB)")
    axes[3].bar([i - width / 2 for i in x], [r["train_loss"] for r in table], width, label="train")
    axes[3].bar([i + width / 2 for i in x], [r["val_loss"] for r in table], width, label="val")
    axes[3].set_title("final loss")
    axes[3].legend()
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=30, ha="right")
    fig.tight_layout()
    out = sweep_dir / "report.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def report_writer(table: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(launcher id, job) of the Hydra process that writes the report of a sweep whose jobs
    ran on several nodes: the one that started rank 0 of its first such job. Every node's
    Hydra process ends the same sweep at about the same time, and where they share the sweep
    directory their reports would be written over each other. None: one node, it writes."""
    for row in table:
        if row.get("nodes", 1) > 1:
            return row["launcher"], row["job"]
    return None


def ran_the_jobs(config: DictConfig) -> bool:
    """Whether this Hydra process ran the sweep's jobs itself (Hydra's basic launcher; with
    several nodes every node's process runs the same sweep) rather than handing them to a
    cluster launcher (submitit: the jobs run in SLURM jobs, and this process alone ends the
    sweep, so it writes the report)."""
    target = str(config.hydra.launcher.get("_target_", ""))
    return target.startswith("hydra._internal.core_plugins.basic_launcher")


class SweepReport(Callback):
    """Hydra callback: after a multirun, compare its jobs side by side."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from recipes.rendezvous import LAUNCHER_ID

        sweep_dir = Path(config.hydra.sweep.dir)
        writer = report_writer(rows(sweep_dir))
        if writer is not None and writer[0] != LAUNCHER_ID and ran_the_jobs(config):
            print(f"sweep report: left to the node that ran rank 0 of job {writer[1]} "
                  f"(its Hydra process {writer[0]})")
            return
        written = write(sweep_dir)
        if written:
            print(f"sweep report: {', '.join(str(p) for p in written)}")
            print(written[0].read_text())


if __name__ == "__main__":
    for p in write(Path(sys.argv[1])):
        print(p)
