"""`kvmesh status --watch`: the cluster's stats as a live table, redrawn every interval.

`status_table` is pure (the stats now, the stats one interval ago, that
interval), so what the table says is tested without a terminal; `watch`
is the loop around it (rich's `Live`), stopped by Ctrl-C or after
`rounds` redraws. Rates (requests per second) come from the difference of
two readings, as a Prometheus ``rate()`` does; the first reading shows none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

from rich.live import Live
from rich.table import Table

from kvmesh.client.mesh import ClusterStats
from kvmesh.errors import InvalidInput
from kvmesh.requests import WorkerStats

COLUMNS: tuple[str, ...] = (
    "worker",
    "role",
    "used",
    "free",
    "cached",
    "running",
    "waiting",
    "requests",
    "req/s",
    "hit ratio",
    "pulled",
    "computed",
    "errors",
)


class StatsSource(Protocol):
    """What the watch reads: a connected `KVMesh`."""

    def stats(self) -> ClusterStats: ...


def _rate(now: int, before: int | None, interval_s: float) -> str:
    if before is None or interval_s <= 0:
        return "-"
    return f"{max(0, now - before) / interval_s:.1f}"


def status_table(
    stats: ClusterStats, previous: ClusterStats | None = None, interval_s: float = 0.0
) -> Table:
    """One row per worker (pages, queue, requests and their rate, hits, pulls, errors) and
    a caption with the coordinator's routes, stale workers and route mismatches."""
    before: dict[str, WorkerStats] = {}
    if previous is not None:
        before = {w.worker_id: w for w in previous.workers}
    stamp = datetime.now(UTC).strftime("%H:%M:%S UTC")
    table = Table(title=f"kvmesh workers (policy {stats.policy}) at {stamp}")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("worker", "role") else "right")
    for w in sorted(stats.workers, key=lambda w: w.worker_id):
        old = before.get(w.worker_id)
        table.add_row(
            w.worker_id,
            w.role,
            str(w.pages_used),
            str(w.pages_free),
            str(w.cached_pages),
            str(w.running),
            str(w.waiting),
            str(w.requests),
            _rate(w.requests, None if old is None else old.requests, interval_s),
            f"{w.page_hit_ratio:.3f}",
            str(w.pages_pulled),
            str(w.pages_computed),
            str(w.errors),
        )
    c = stats.coordinator
    table.caption = (
        f"routes {c.get('routes', 0)}  stale workers {c.get('stale_workers', 0)}  "
        f"draining {c.get('draining_workers', 0)}  indexed pages {c.get('indexed_pages', 0)}  "
        f"mismatches {stats.mismatches}  cluster hit ratio {stats.page_hit_ratio:.3f}"
    )
    return table


def watch(
    source: StatsSource,
    console: Any,
    interval_s: float = 2.0,
    *,
    rounds: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Redraw `status_table` every `interval_s` until Ctrl-C (or `rounds` redraws); returns
    the redraws made. Raises `InvalidInput` for an interval that is not positive."""
    if not interval_s > 0:
        raise InvalidInput(f"--interval must be a positive number of seconds, got {interval_s}")
    previous: ClusterStats | None = None
    made = 0
    with Live(console=console, auto_refresh=False) as live:
        try:
            while rounds is None or made < rounds:
                if made:
                    sleep(interval_s)
                stats = source.stats()
                live.update(status_table(stats, previous, interval_s), refresh=True)
                previous = stats
                made += 1
        except KeyboardInterrupt:  # the way to stop watching
            pass
    return made


__all__ = ["COLUMNS", "status_table", "watch"]
