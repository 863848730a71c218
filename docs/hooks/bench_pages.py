"""MkDocs hook: one page per benchmark run, generated from the run's output file.

Each ``docs/performance/runs/<name>.json`` is what ``python bench/compare.py --matrix`` (or
``--combine``) wrote for one benchmark run (``{"created", "command", "commit", "notes",
"runs": [...]}``, one record per system x regime x precision). The hook renders each file as
``performance/<name>.md`` and lists the pages, newest first, on ``performance/index.md``, so
the figures on the site are never typed by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RUNS = "performance/runs"
_COLUMNS = [
    ("system", "system", "{}"),
    ("regime", "regime", "{}"),
    ("precision", "precision", "{}"),
    ("median_step_s", "s/step (median)", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("peak_rss_delta_mib_max", "peak RSS growth, MiB (max over ranks)", "{:.0f}"),
    ("model_state_mib_max", "model states, MiB/rank", "{:.0f}"),
    ("formula_mib", "ZeRO formula, MiB/rank", "{:.0f}"),
    ("first_loss", "first loss", "{:.4f}"),
    ("max_loss_diff_vs_ddp", "max loss difference to DDP", "{:.1e}"),
    ("error", "error", "{}"),
]


def _runs(docs_dir: Path) -> list[Path]:
    return sorted((docs_dir / RUNS).glob("*.json"), reverse=True)


def _cell(record: dict[str, Any], key: str, fmt: str) -> str:
    value = record.get(key)
    if value is None:
        return ""
    return fmt.format(value) if isinstance(value, (int, float)) else str(value)


def render(data: dict[str, Any], name: str) -> str:
    commit = f" at commit `{data['commit']}`" if data.get("commit") else ""
    lines = [f"# Benchmark run {name}", "", f"Written {data.get('created', 'at an unknown time')}"
             f"{commit} from `docs/{RUNS}/{name}.json`; do not edit this page, rerun the"
             " benchmark.", ""]
    if data.get("command"):
        lines += ["```bash", data["command"], "```", ""]
    for note in data.get("notes", []):
        lines += [note, ""]
    lines += ["| " + " | ".join(title for _, title, _ in _COLUMNS) + " |",
              "|" + "---|" * len(_COLUMNS)]
    for record in data["runs"]:
        lines.append("| " + " | ".join(_cell(record, k, f) for k, _, f in _COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def on_files(files: Files, config: Any) -> Files:
    docs_dir = Path(config["docs_dir"])
    for path in _runs(docs_dir):
        data = json.loads(path.read_text())
        files.append(File.generated(config, f"performance/{path.stem}.md",
                                    content=render(data, path.stem)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri != "performance/index.md":
        return markdown
    runs = _runs(Path(config["docs_dir"]))
    listing = "\n".join(f"- [{p.stem}]({p.stem}.md)" for p in runs) or "- (no run recorded yet)"
    return markdown.replace("<!-- runs -->", listing)
