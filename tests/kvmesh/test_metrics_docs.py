"""docs/operations.md lists every metric, as kvmesh.metrics defines it."""

from __future__ import annotations

from pathlib import Path

from kvmesh.metrics import ALL_METRICS, metrics_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
BEGIN, END = "<!-- metrics table: begin -->\n", "<!-- metrics table: end -->"


def test_the_committed_metrics_table_is_the_generated_one() -> None:
    text = DOC.read_text(encoding="utf-8")
    committed = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    assert committed == metrics_table(), (
        "docs/operations.md's metrics table drifted from kvmesh/metrics.py: paste "
        "kvmesh.metrics.metrics_table() between its markers"
    )


def test_the_table_has_a_row_per_metric() -> None:
    rows = [line for line in metrics_table().splitlines() if line.startswith("| `")]
    assert len(rows) == len(ALL_METRICS)
