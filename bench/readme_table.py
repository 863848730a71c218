"""The README's performance table, generated from a run file of ``bench/compare.py``.

    python bench/readme_table.py [RUN_JSON]           # rewrite the table in README.md
    python bench/readme_table.py [RUN_JSON] --check   # exit 1 if README.md's table differs
    python bench/readme_table.py [RUN_JSON] --print   # print the table only

RUN_JSON defaults to the newest ``docs/performance/runs/*.json`` (the first page the docs
list), so ``--check`` also fails once a newer run is recorded and the README still shows an
older one. Below the run's table, a second one gives each regime's activations by the
activation formula (``zs.estimate_activations``), with and without checkpointing. The tables
replace everything between the lines ``<!-- bench:table -->`` and
``<!-- /bench:table -->`` in the README; what surrounds them is prose, left to people.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "docs" / "performance" / "runs"
BEGIN, END = "<!-- bench:table -->", "<!-- /bench:table -->"

# (row label, systems shown in it, label in bold): one row per family, one system per stage
ROWS = [
    ("DDP", ["ddp"], False),
    ("torch ZeRO-1 / FSDP2 zero2 / FSDP2 zero3", ["torch_zero1", "fsdp2_zero2", "fsdp2_zero3"],
     False),
    ("DeepSpeed zero1 / zero2 / zero3", ["ds_zero1", "ds_zero2", "ds_zero3"], False),
    ("zero_strategy zero1 / zero2 / zero3", ["zs_zero1", "zs_zero2", "zs_zero3"], True),
]
# (regime, figure, heading, format): the columns after the system's
COLUMNS = [
    ("throughput", "median_step_s", "s/step", "{:.3f}"),
    ("memory", "median_step_s", "s/step", "{:.3f}"),
    ("memory", "peak_rss_delta_mib_max", "peak RSS growth (MiB)", "{:.0f}"),
]


def _ok(record: dict[str, Any]) -> bool:
    return not record.get("error") and record.get("median_step_s") is not None


def _stage(system: str) -> str:
    """Systems compared with each other in bold: the same ZeRO stage (DDP is stage 0)."""
    return system[-1] if system[-1].isdigit() else "0"


def _best(records: dict[tuple[str, str], dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(system, regime, figure) of each column's smallest figure among the systems of one
    stage, where at least two of them were measured."""
    best = set()
    for regime, figure, _, _ in COLUMNS:
        by_stage: dict[str, list[tuple[float, str]]] = {}
        for _, systems, _ in ROWS:
            for system in systems:
                record = records.get((system, regime))
                if record is not None and _ok(record):
                    by_stage.setdefault(_stage(system), []).append((record[figure], system))
        for measured in by_stage.values():
            if len(measured) > 1:
                best.add((min(measured)[1], regime, figure))
    return best


def _headings(records: list[dict[str, Any]]) -> list[str]:
    """Each column's heading, the model's size named in the first column of its regime."""
    headings, named = [], set()
    for regime, _, title, _ in COLUMNS:
        sizes = {r["n_params"] for r in records if r["regime"] == regime and r.get("n_params")}
        size = f", {sizes.pop() / 1e6:.3g}M params" if len(sizes) == 1 and regime not in named \
            else ""
        named.add(regime)
        headings.append(f"{regime}{size}: {title}")
    return headings


def table(run: dict[str, Any], precision: str = "fp32") -> list[str]:
    runs = [r for r in run["runs"] if r.get("precision", precision) == precision]
    records = {(r["system"], r["regime"]): r for r in runs}
    best = _best(records)
    lines = ["| system | " + " | ".join(_headings(runs)) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for label, systems, ours in ROWS:
        if not any((s, regime) in records for s in systems for regime, *_ in COLUMNS):
            continue  # a family this run did not include
        cells = []
        for regime, figure, _, fmt in COLUMNS:
            values = []
            for system in systems:
                record = records.get((system, regime))
                value = "–" if record is None else fmt.format(record[figure]) if _ok(
                    record) else "failed"
                values.append(f"**{value}**" if (system, regime, figure) in best else value)
            cells.append(" / ".join(values))
        lines.append(f"| {f'**{label}**' if ours else label} | " + " | ".join(cells) + " |")
    return lines


def activation_table(run: dict[str, Any], precision: str = "fp32") -> list[str]:
    """Each regime's activations per rank by the formula, for the GPT-2 that
    ``bench/compare.py`` builds for it now: none of the systems compared checkpoints, so the
    first column is what each of them holds; the second is what checkpointing would."""
    from compare import REGIMES, gpt_config

    import zero_strategy as zs

    regimes = [name for name in REGIMES
               if any(r["regime"] == name and r.get("precision", precision) == precision
                      for r in run["runs"])]
    if not regimes:
        return []
    mib = 2.0**20
    lines = ["| regime: activations per rank (formula, MiB) | no checkpointing: saved / "
             "backward peak | each block checkpointed: saved / backward peak |", "|---|---|---|"]
    for name in regimes:
        regime = REGIMES[name]
        plain, ckpt = (zs.estimate_activations(
            gpt_config(regime), batch_size=regime.batch, seq_len=regime.seq,
            precision="32-true", checkpointing=c) for c in (False, True))
        lines.append(f"| {name}: {regime.batch} x {regime.seq} tokens, {regime.layers} layers "
                     f"of width {regime.width} | {plain.saved_bytes / mib:.1f} / "
                     f"{plain.peak_bytes / mib:.1f} | {ckpt.saved_bytes / mib:.1f} / "
                     f"{ckpt.peak_bytes / mib:.1f} |")
    return lines + ["", "Activations: what one rank's micro-batch leaves for backward and its "
                    "backward peak, by the formula of [docs/activations.md](docs/activations.md) "
                    "for each regime's GPT-2 (the same under every system above: none of them "
                    "checkpoints)."]


def _failures(run: dict[str, Any]) -> list[str]:
    shown = {s for _, systems, _ in ROWS for s in systems}
    failed = [r for r in run["runs"] if r["system"] in shown and not _ok(r)]
    if not failed:
        return []
    why: dict[str, list[str]] = {}
    for r in failed:
        why.setdefault(str(r.get("error") or "failed"), []).append(f"{r['system']} {r['regime']}")
    return ["", "Failed: " + "; ".join(f"{', '.join(names)} ({error})"
                                       for error, names in why.items()) + "."]


def block(run: dict[str, Any], run_path: Path) -> list[str]:
    try:
        shown = run_path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        shown = run_path.as_posix()
    commit = f", commit {run['commit']}" if run.get("commit") else ""
    lines = [BEGIN, *table(run), *_failures(run), "",
             "Bold: the smallest figure among the systems at the same ZeRO stage.",
             f"Run of {run.get('created', '?')}{commit} (`{shown}`), made by:", ""]
    if run.get("command"):
        lines += ["```bash", run["command"], "```", ""]
    activations = activation_table(run)
    lines += [*activations, ""] if activations else []
    lines += [f"Generated by `python bench/readme_table.py {shown}`; do not edit by hand.", END]
    return lines


def replace_block(text: str, new: list[str], readme: Path) -> str:
    lines = text.split("\n")
    try:
        start, stop = lines.index(BEGIN), lines.index(END)
    except ValueError:
        raise SystemExit(f"{readme}: no lines {BEGIN} and {END} to put the table between") from None
    if stop < start:
        raise SystemExit(f"{readme}: {END} comes before {BEGIN}")
    return "\n".join(lines[:start] + new + lines[stop + 1:])


def newest_run() -> Path:
    runs = sorted(RUNS.glob("*.json"), reverse=True)  # the order the docs list them in
    if not runs:
        raise SystemExit(f"no run files in {RUNS}")
    return runs[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", nargs="?", type=Path, help="a run file (default: the newest)")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the README differs")
    mode.add_argument("--print", action="store_true", help="print the table, change nothing")
    args = p.parse_args()
    run_path = args.run or newest_run()
    new = block(json.loads(run_path.read_text()), run_path)
    if args.print:
        print("\n".join(new))
        return
    text = args.readme.read_text()
    updated = replace_block(text, new, args.readme)
    if args.check:
        if updated != text:
            sys.stdout.writelines(difflib.unified_diff(
                text.splitlines(True), updated.splitlines(True), str(args.readme),
                f"{args.readme} from {run_path}"))
            raise SystemExit(1)
        print(f"{args.readme}: the table is {run_path}'s")
        return
    if updated != text:
        args.readme.write_text(updated)
    print(f"{args.readme}: table from {run_path}")


if __name__ == "__main__":
    main()
