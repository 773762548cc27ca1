"""kvmesh.app.report: the one table and plot the demo and the simulator compare policies in."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kvmesh.app.demo import DEMO_ROWS
from kvmesh.app.report import SHARED_ROWS, Row, plot_comparison, print_comparison
from kvmesh.app.simulate import SIM_ROWS


@dataclass(frozen=True, slots=True)
class Figures:
    policy: str
    page_hit_ratio: float
    pulled_pages: int
    reuse_ratio: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    requests_per_s: float


A = Figures("kv_aware", 0.5, 7, 0.75, 12.0, 10.0, 40.0, 3.25)
B = Figures("round_robin", 0.125, 0, 0.125, 30.0, 28.0, 90.0, 1.5)


def printed(rows: tuple[Row, ...]) -> list[str]:
    out = io.StringIO()
    print_comparison([A, B], rows, "title", Console(file=out, width=120))
    return out.getvalue().splitlines()


def test_the_table_has_a_row_per_figure_and_a_column_per_policy() -> None:
    lines = printed((*SHARED_ROWS, Row("requests / s", "requests_per_s", "{:.2f}")))
    header = next(line for line in lines if "kv_aware" in line)
    assert header.index("kv_aware") < header.index("round_robin")
    row = next(line for line in lines if "TTFT p99" in line)
    assert row.index("40.0") < row.index("90.0")
    assert any("requests / s" in line and "3.25" in line and "1.50" in line for line in lines)
    assert any("pulled pages" in line and "7" in line for line in lines)


def test_demo_and_simulator_share_the_common_figures_in_one_order() -> None:
    for rows in (DEMO_ROWS, SIM_ROWS):
        keys = [r.key for r in rows]
        shared = [r.key for r in SHARED_ROWS]
        start = keys.index(shared[0])
        assert keys[start : start + len(shared)] == shared


def test_the_plot_is_a_png_with_the_callers_own_figure(tmp_path: Path) -> None:
    path = plot_comparison(
        [A, B], tmp_path / "sub" / "cmp.png", "t", own=Row("req/s", "requests_per_s"), bound=0.9
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
