"""The cluster bench's arithmetic and words (bench/cluster_page.py, bench/cluster_bench.py),
on made-up rows in process: each system's floor is ``max(link bytes / link rate,
forward+backward) + its optimizer share``, the README's rows name only what the run
measured, and a failed run is reported by the rank's own exception, not by torchrun's
wrapper of it (the page of 2026-11-29's first render said only ``ChildFailedError`` for
DeepSpeed's qwZ, whose op has no CPU build)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import cluster_bench  # noqa: E402
import cluster_page  # noqa: E402


def _row(system: str, layout: str = "2x1", regime: str = "throughput",
         step: float = 1.5) -> dict[str, Any]:
    return {
        "layout": layout, "rate": "1gbit", "regime": regime, "round": 0, "system": system,
        "ok": True, "median_step_s": step, "losses": [9.0, 8.5],
        "loadavg_before": [1.0], "link": {"bytes_per_s": 100e6},
        "link_bytes_per_step": {"sent": 80e6, "received": 60e6},
        "parts": {"fwd_bwd_s": 0.5, "adamw_full_s": 0.1, "adamw_world_s": 0.05,
                  "adamw_local_s": 0.1, "codec_s": 0.0},
    }


def test_a_floor_is_the_busier_of_link_and_compute_plus_the_optimizer_share() -> None:
    # link: the larger direction, 80 MB at 100 MB/s = 0.8 s, above compute's 0.5 s; DDP
    # steps the whole model (0.1 s), a ZeRO system its 1/N (0.05 s)
    ddp = cluster_page.analyse(_row("ddp"))
    assert ddp["link_s"] == pytest.approx(0.8)
    assert ddp["floor_s"] == pytest.approx(0.9)
    assert ddp["multiple"] == pytest.approx(1.5 / 0.9)
    ds = cluster_page.analyse(_row("ds_zero3", step=1.7))
    assert ds["floor_s"] == pytest.approx(0.85)
    assert ds["multiple"] == pytest.approx(2.0)


def test_the_readme_rows_name_only_what_the_run_measured(tmp_path: Path) -> None:
    page = Path("docs/performance/cluster-x.md")
    only = {"created": "2026-11-29 17:52", "rows": [_row("ddp"), _row("ds_zero3")]}
    note = cluster_page.readme_rows(only, page)[-1]
    assert "with the predictions" in note
    assert "memory" not in note and "2 x 2" not in note
    both = {"created": "2026-11-29 17:52",
            "rows": [_row("ddp"), _row("ddp", layout="2x2"), _row("ddp", regime="memory")]}
    note = cluster_page.readme_rows(both, page)[-1]
    assert "with the memory regime, 2 x 2 and the predictions" in note
    rows = cluster_page.readme_rows(only, page)
    assert rows[2] == "| ddp | 1.500 (1.67x) |"


def test_a_failed_run_is_reported_by_the_rank_s_own_exception(tmp_path: Path) -> None:
    (tmp_path / "node0.log").write_text(
        "[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "compare.py", line 9, in <module>\n'
        "[rank0]:     raise ValueError(\"This op had not been implemented on CPU backend.\")\n"
        "[rank0]: ValueError: This op had not been implemented on CPU backend.\n"
        "Traceback (most recent call last):\n"
        "    raise ChildFailedError(\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "  error_file: <N/A>\n")
    (tmp_path / "node1.log").write_text("")
    assert cluster_bench._last_error(tmp_path) == (
        "ValueError: This op had not been implemented on CPU backend.")
    (tmp_path / "node0.log").write_text("all fine\n")
    assert cluster_bench._last_error(tmp_path) == "no error in the logs"


def test_the_page_gives_each_cluster_s_own_link_rate() -> None:
    # Each layout builds its own cluster and measures its link: the 2 x 2 cluster's rate
    # must not stand for the 2 x 1 one's (the first page named one rate per link speed).
    one, two = _row("ddp"), _row("ddp", layout="2x2")
    two["link"] = {"bytes_per_s": 90e6}
    text = cluster_page.render({"created": "2026-11-29 17:52", "command": "x", "rows": [one, two],
                                "loadavg_before": [1.0]})
    assert "2x1 1gbit: 100.0 MB/s, 2x2 1gbit: 90.0 MB/s" in text
