"""How the demo and the simulator show routing policies side by side.

Both measure, per policy, the prompt pages reused (local hits, then pulled
from peers) and TTFT (mean, p50, p99), and each adds figures of its own (the
simulator its load imbalance, the demo its requests per second). One table
shape (a row per figure, a column per policy) and one plot (TTFT, pages
reused against the bound, one figure of the caller's) serve both, so the two
commands read alike and a fix to one is a fix to both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rich.console import Console
from rich.table import Table


class ComparedPolicy(Protocol):
    """The figures every policy report has (`getattr` reads the rest by `Row.key`)."""

    @property
    def policy(self) -> str: ...
    @property
    def page_hit_ratio(self) -> float: ...
    @property
    def reuse_ratio(self) -> float: ...
    @property
    def ttft_mean_ms(self) -> float: ...
    @property
    def ttft_p50_ms(self) -> float: ...
    @property
    def ttft_p99_ms(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Row:
    """One figure of a report: its label, the report's attribute, a format spec."""

    label: str
    key: str
    fmt: str = "{}"

    def cell(self, report: ComparedPolicy) -> str:
        return self.fmt.format(getattr(report, self.key))


SHARED_ROWS: tuple[Row, ...] = (
    Row("page hit ratio", "page_hit_ratio", "{:.3f}"),
    Row("pulled pages", "pulled_pages"),
    Row("reuse ratio (hit + pulled)", "reuse_ratio", "{:.3f}"),
    Row("TTFT mean (ms)", "ttft_mean_ms", "{:.1f}"),
    Row("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
    Row("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
)
"""The figures both commands print, in this order, between their own."""


def comparison_table(
    reports: Sequence[ComparedPolicy], rows: Sequence[Row], title: str
) -> Table:
    """A row per figure, a column per policy (policies are few, figures many)."""
    table = Table(title=title)
    table.add_column("metric")
    for r in reports:
        table.add_column(r.policy, justify="right")
    for row in rows:
        table.add_row(row.label, *(row.cell(r) for r in reports))
    return table


def print_comparison(
    reports: Sequence[ComparedPolicy],
    rows: Sequence[Row],
    title: str,
    console: Console | None = None,
) -> None:
    """Print `comparison_table`; never narrower than 120 columns (a pipe would cut it)."""
    if console is None:
        console = Console()
        if console.width < 120:
            console = Console(width=120)
    console.print(comparison_table(reports, rows, title))


def plot_comparison(
    reports: Sequence[ComparedPolicy],
    path: Path,
    title: str,
    *,
    own: Row,
    own_line: float | None = None,
    bound: float | None = None,
) -> Path:
    """A PNG of three panels, a group per policy: TTFT mean / p50 / p99 (log scale),
    prompt pages reused (local hits and pulls stacked, the `bound` dashed), and the
    caller's `own` figure (with a dashed `own_line`, e.g. perfect balance)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    names = [r.policy for r in reports]
    xs = list(range(len(reports)))
    fig, axes = plt.subplots(1, 3, figsize=(max(13.0, 2.2 * len(reports) + 4), 4.5))
    width = 0.26
    for k, key in enumerate(("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms")):
        values = [max(getattr(r, key), 1e-3) for r in reports]  # log scale: no zeros
        bars = axes[0].bar([x + (k - 1) * width for x in xs], values, width, label=key[5:8])
        axes[0].bar_label(bars, fmt="%.0f", fontsize=7)
    axes[0].set_yscale("log")
    axes[0].set_title("TTFT (ms)")
    axes[0].legend(fontsize=8)
    local = [r.page_hit_ratio for r in reports]
    pulled = [r.reuse_ratio - r.page_hit_ratio for r in reports]
    axes[1].bar(xs, local, 0.5, label="local hits")
    axes[1].bar(xs, pulled, 0.5, bottom=local, label="pulled from peers")
    if bound is not None:
        axes[1].axhline(bound, color="grey", linestyle="--", label=f"bound {bound:.2f}")
    axes[1].set_ylim(0, 1)
    axes[1].set_title("prompt pages reused")
    axes[1].legend(loc="lower right", fontsize=8)
    bars = axes[2].bar(xs, [getattr(r, own.key) for r in reports], 0.5, color="tab:green")
    axes[2].bar_label(bars, fmt="%.2f", fontsize=8)
    if own_line is not None:
        axes[2].axhline(own_line, color="k", linestyle="--", lw=1)
    axes[2].set_title(own.label)
    for ax in axes:
        ax.set_xticks(xs)
        tilt = len(names) > 3  # long policy names side by side overlap
        ax.set_xticklabels(names, rotation=30 if tilt else 0, ha="right" if tilt else "center")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
