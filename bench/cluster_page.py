"""The page and the README rows of a ``bench/cluster_bench.py`` run: each system's step beside
its overlapped floor and beside ``zero_strategy.perf``'s prediction, its link bytes beside
the formula, its losses.

    python bench/cluster_bench.py --from-json bench/results/cluster-<date>.json --page PAGE.md

A row is the median over the run's rounds of a (layout, link, regime, system); each round
compares the system with the parts measured in the same round.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

README_BEGIN, README_END = "<!-- bench:cluster -->", "<!-- /bench:cluster -->"
MB = 1e6
# The optimizer's share of the model each system steps: the whole of it, a 1/N shard, or a
# hybrid system's 1/P (its shard group is a node).
OPTIMIZER_SHARE = {"ddp": "adamw_full_s", "fsdp2_hsdp": "adamw_local_s",
                   "zs_zero3_hpz": "adamw_local_s", "zs_zero3_hpz_int8": "adamw_local_s"}
# Ours, as zero_strategy.perf sees them: (stage, int8 weights and gradients, hybrid); the
# unchecked one runs without the gather-order check.
OURS = {"zs_zero0": (0, False, False), "zs_zero1": (1, False, False),
        "zs_zero2": (2, False, False), "zs_zero3": (3, False, False),
        "zs_zero3_unchecked": (3, False, False),
        "zs_zero3_int8": (3, True, False), "zs_zero3_hpz": (3, False, True),
        "zs_zero3_hpz_int8": (3, True, True)}
# The anchors' ZeRO stage and whether they shard within a node (the formula's bytes, rings).
ANCHORS = {"ddp": (0, False), "fsdp2_zero3": (3, False), "fsdp2_hsdp": (3, True),
           "ds_zero3": (3, False), "ds_zero3_hpz": (3, False), "ds_zero3_qwz": (3, False),
           "ds_zero3_qgz": (3, False)}


def save_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


# -- one round of one system --------------------------------------------------------------------

def analyse(row: dict[str, Any]) -> dict[str, Any]:
    """The row's floor, its multiple, the formula's bytes and (ours) the prediction."""
    parts, link = row["parts"], row["link"]["bytes_per_s"]
    out: dict[str, Any] = {"system": row["system"], "ok": bool(row.get("ok"))}
    if not out["ok"] or "fwd_bwd_s" not in parts:
        out["error"] = row.get("error") or parts.get("error") or "no record"
        return out
    measured = row["link_bytes_per_step"]
    nbytes = max(measured["sent"], measured["received"])
    optimizer = parts[OPTIMIZER_SHARE.get(row["system"], "adamw_world_s")]
    floor = max(nbytes / link, parts["fwd_bwd_s"]) + optimizer
    out.update(step_s=row["median_step_s"], link_bytes=nbytes, link_s=nbytes / link,
               compute_s=parts["fwd_bwd_s"], optimizer_s=optimizer, floor_s=floor,
               multiple=row["median_step_s"] / floor, losses=row["losses"],
               load=row["loadavg_before"][0])
    nodes, per_node = _layout(row["layout"])
    formula, predicted = expected(row["system"], row["regime"], nodes, per_node, link, parts)
    out["formula_bytes"] = formula
    if predicted is not None:
        out["predicted_s"] = predicted
    return out


def _layout(name: str) -> tuple[int, int]:
    nodes, per_node = name.split("x")
    return int(nodes), int(per_node)


def expected(system: str, regime: str, nodes: int, per_node: int, link: float,
             parts: dict[str, float]) -> tuple[float | None, float | None]:
    """Bytes leaving a node per step by the formula, and (ours) the predicted step."""
    from zero_strategy.perf import Layout, ModelUnits, Options, node_bytes, step_collectives
    from zero_strategy.perf.steptime import Rates, predict

    if system in OURS:
        stage, int8, hybrid = OURS[system]
        layout = Layout(nodes, per_node, per_node if hybrid else None)
        units = _units(regime, stage, layout)
        options = Options(stage=stage, quantize_weights=int8, quantize_gradients=int8)
        rates = Rates(link, parts["fwd_bwd_s"], parts["adamw_full_s"], parts.get("codec_s", 0))
        # checked or not, stage 3's schedule is the same: the check's headers ride beside
        # the gathers (zero_strategy.perf.steptime.schedule)
        prediction = predict(units, options, layout, rates)
        return prediction.link_bytes, prediction.step_s
    if system in ANCHORS:
        stage, hybrid = ANCHORS[system]
        layout = Layout(nodes, per_node, per_node if hybrid else None)
        units = ModelUnits.plain(_n_params(regime))
        ring = Options(stage=stage, backend="nccl")  # the formula's: rings, nothing kept
        return node_bytes(step_collectives(units, ring, layout), layout), None
    return None, None


@cache
def _units(regime: str, stage: int, layout: Any) -> Any:
    """The engine's units of the regime's GPT-2 (built on the meta device)."""
    import torch
    from compare import REGIMES, gpt_config
    from transformers import GPT2LMHeadModel

    import zero_strategy as zs
    from zero_strategy.perf import model_units

    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt_config(REGIMES[regime]))
    config = zs.ZeroConfig(stage=stage, shard_group_size=layout.shard_group if stage else None)
    return model_units(model, config, layout)


@cache
def _n_params(regime: str) -> int:
    import torch
    from compare import REGIMES, gpt_config
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        return sum(p.numel() for p in GPT2LMHeadModel(gpt_config(REGIMES[regime])).parameters())


# -- rows over rounds ---------------------------------------------------------------------------

def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (layout, rate, regime, system), the median over its rounds, with the
    largest loss difference to DDP's run of the same round."""
    ddp = {(r["layout"], r["rate"], r["regime"], r["round"]): r.get("losses")
           for r in rows if r["system"] == "ddp" and r.get("ok")}
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["layout"], row["rate"], row["regime"], row["system"])
        one = analyse(row)
        reference = ddp.get((row["layout"], row["rate"], row["regime"], row["round"]))
        if one["ok"] and reference and row["system"] != "ddp":
            one["loss_diff"] = max(abs(a - b) for a, b in zip(one["losses"], reference))
        one["link_rate"] = row["link"]["bytes_per_s"]
        groups.setdefault(key, []).append(one)
    out = []
    for (layout, rate, regime, system), runs in groups.items():
        good = [r for r in runs if r["ok"]]
        entry: dict[str, Any] = {"layout": layout, "rate": rate, "regime": regime,
                                 "system": system, "rounds": len(runs), "ok": bool(good)}
        if not good:
            entry["error"] = runs[0]["error"]
        else:
            for key in ("step_s", "link_bytes", "link_s", "compute_s", "optimizer_s",
                        "floor_s", "multiple", "formula_bytes", "predicted_s", "load",
                        "loss_diff", "link_rate"):
                values = [r[key] for r in good if r.get(key) is not None]
                entry[key] = statistics.median(values) if values else None
            entry["first_loss"], entry["last_loss"] = good[0]["losses"][0], good[0]["losses"][-1]
        out.append(entry)
    return out


# -- rendering ----------------------------------------------------------------------------------

def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(entries: Iterable[dict[str, Any]]) -> list[str]:
    lines = ["| system | link | s/step | forward+backward | optimizer | link time | floor | "
             "x floor | MB/step/node | formula MB | predicted s/step | predicted / measured "
             "| first loss | last loss | max loss diff to DDP | load |",
             "|" + "---|" * 16]
    for e in entries:
        if not e["ok"]:
            lines.append(f"| {e['system']} | {e['rate']} | failed: "
                         f"{e['error'].replace('|', '/')} |" + " |" * 13)
            continue
        ratio = (e["predicted_s"] / e["step_s"]) if e.get("predicted_s") else None
        lines.append(
            f"| {e['system']} | {e['rate']} | {e['step_s']:.3f} | {e['compute_s']:.3f} | "
            f"{e['optimizer_s']:.3f} | {e['link_s']:.3f} | {e['floor_s']:.3f} | "
            f"{e['multiple']:.2f} | {e['link_bytes'] / MB:.1f} | "
            f"{_f(e['formula_bytes'] and e['formula_bytes'] / MB, '.1f')} | "
            f"{_f(e.get('predicted_s'), '.3f')} | {_f(ratio, '.2f')} | "
            f"{e['first_loss']:.4f} | {e['last_loss']:.4f} | {_f(e.get('loss_diff'), '.1e')} | "
            f"{_f(e['load'], '.1f')} |")
    return lines


def render(data: dict[str, Any]) -> str:
    entries = summarise(data["rows"])
    links = {(r["layout"], r["rate"]): r["link"] for r in data["rows"]}  # one per cluster
    lines = [f"# Across a link, {data['created'][:10]}", "",
             "Every system trained across a shaped link of the cluster in a box "
             "(`bench/cluster.py`: each node a network namespace, each link limited each way "
             "by `tc tbf`), beside its overlapped floor, `max(link bytes / link rate, "
             "forward+backward) + optimizer`, and beside `zero_strategy.perf`'s prediction "
             "(`bench/README.md`, \"Across a link\", says what every figure means). Written by "
             "`bench/cluster_bench.py`; do not edit, rerun it.", "",
             f"- Command: `{data['command']}`",
             f"- Load average (1 min) {data['loadavg_before'][0]:.1f} at the start, "
             f"{data.get('loadavg_after', ['?'])[0]} at the end; each row gives the load when "
             f"its run began. {data.get('minutes', 0):.0f} min in all.",
             "- The links' measured rates, each way with both ways busy, per cluster: " +
             ", ".join(f"{layout} {rate}: {link['bytes_per_s'] / MB:.1f} MB/s"
                       for (layout, rate), link in links.items()) + "."]
    lines += [f"- Note: {note}" for note in data.get("notes", [])]
    for regime in ("throughput", "memory"):
        for layout in ("2x1", "2x2"):
            chosen = [e for e in entries if e["regime"] == regime and e["layout"] == layout]
            if not chosen:
                continue
            nodes, per_node = _layout(layout)
            lines += ["", f"## {regime} regime, {nodes} nodes x {per_node} "
                      f"process{'es' if per_node > 1 else ''}", ""]
            lines += table(sorted(chosen, key=lambda e: (e["rate"], _order(e["system"]))))
    return "\n".join(lines) + "\n"


def _order(system: str) -> int:
    names = list(ANCHORS) + list(OURS)
    return names.index(system) if system in names else len(names)


def readme_rows(data: dict[str, Any], page: Path) -> list[str]:
    """The README's rows: the throughput regime at 2 x 1, each link, ours beside the anchors."""
    entries = [e for e in summarise(data["rows"]) if e["regime"] == "throughput"
               and e["layout"] == "2x1" and e["ok"]]
    rates = sorted({e["rate"] for e in entries})
    lines = ["| system | " + " | ".join(f"{r}: s/step (x floor)" for r in rates) + " |",
             "|---|" + "---|" * len(rates)]
    for system in sorted({e["system"] for e in entries}, key=_order):
        cells = []
        for rate in rates:
            found = [e for e in entries if e["system"] == system and e["rate"] == rate]
            cells.append(f"{found[0]['step_s']:.3f} ({found[0]['multiple']:.2f}x)" if found
                         else "-")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    rows = data["rows"]
    more = [what for what, present in (
        ("the memory regime", any(r.get("regime") == "memory" for r in rows)),
        ("2 x 2", any(r.get("layout") == "2x2" for r in rows))) if present]
    lines += ["", f"2 nodes x 1 process, throughput regime, fp32; generated by "
              f"`bench/cluster_bench.py` on {data['created']} ([the page]({page.as_posix()}), "
              f"with {_listed(more + ['the predictions'])}); do not edit by hand."]
    return lines


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def write(data: dict[str, Any], page: Path | None, readme: Path | None) -> None:
    text = render(data)
    print(text)
    if page:
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(text)
    if readme and page:
        content = readme.read_text()
        if README_BEGIN not in content or README_END not in content:
            raise SystemExit(f"{readme}: no {README_BEGIN} ... {README_END} block to rewrite")
        head, rest = content.split(README_BEGIN, 1)
        _, tail = rest.split(README_END, 1)
        link = page.relative_to(readme.parent) if page.is_absolute() else page
        block = [README_BEGIN, *readme_rows(data, link), README_END]
        readme.write_text(head + "\n".join(block) + tail)
