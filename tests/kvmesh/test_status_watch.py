"""`kvmesh status --watch`: the live table's rows, rates and caption, and its redraw loop."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from kvmesh.app.watch import COLUMNS, status_table, watch
from kvmesh.client.mesh import ClusterStats
from kvmesh.errors import InvalidInput
from kvmesh.requests import WorkerStats
from kvmesh.types import WorkerId


def worker(wid: str, requests: int, **kw: Any) -> WorkerStats:
    base: dict[str, Any] = dict(
        worker_id=WorkerId(wid),
        role="both",
        address="127.0.0.1:1",
        incarnation="i",
        num_pages=63,
        pages_used=10,
        pages_free=53,
        cached_pages=8,
        running=1,
        waiting=2,
        requests=requests,
        errors=0,
        prompt_pages=10,
        pages_hit_local=4,
        pages_pulled=1,
        pages_computed=5,
        pages_pushed=0,
        batches_sent=3,
        snapshots_sent=1,
        last_seq=3,
        draining=False,
    )
    base.update(kw)
    return WorkerStats(**base)


def cluster(*workers: WorkerStats, **coordinator: Any) -> ClusterStats:
    return ClusterStats("kv_aware", workers, {"routes": 7, "stale_workers": 1, **coordinator})


def rendered(renderable: Any) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def test_a_row_per_worker_with_pages_queue_requests_hits_and_errors() -> None:
    text = rendered(status_table(cluster(worker("w1", 5, errors=2), worker("w0", 3))))
    for col in COLUMNS:
        assert col in text
    rows = [line for line in text.splitlines() if "│ w" in line]
    assert [r.split("│")[1].strip() for r in rows] == ["w0", "w1"]  # sorted by worker
    w1 = [cell.strip() for cell in rows[1].split("│")[1:-1]]
    assert w1 == ["w1", "both", "10", "53", "8", "1", "2", "5", "-", "0.400", "1", "5", "2"]


def test_the_request_rate_is_the_difference_of_two_readings_over_the_interval() -> None:
    before = cluster(worker("w0", 10), worker("w1", 4))
    now = cluster(worker("w0", 15), worker("w1", 4), worker("w2", 1))
    text = rendered(status_table(now, before, interval_s=2.0))
    rates = {
        cells[0]: cells[8]
        for line in text.splitlines()
        if "│ w" in line
        for cells in [[c.strip() for c in line.split("│")[1:-1]]]
    }
    assert rates == {"w0": "2.5", "w1": "0.0", "w2": "-"}  # w2 joined: no reading before


def test_the_caption_has_the_coordinators_routes_stale_workers_and_mismatches() -> None:
    text = rendered(status_table(cluster(worker("w0", 1), mismatches=3)))
    assert "routes 7" in text and "stale workers 1" in text and "mismatches 3" in text


class Readings:
    """Successive cluster readings, as a connected mesh would return them."""

    def __init__(self) -> None:
        self.calls = 0

    def stats(self) -> ClusterStats:
        self.calls += 1
        return cluster(worker("w0", 10 * self.calls))


def test_watch_redraws_every_interval_until_its_rounds_are_done() -> None:
    slept: list[float] = []
    readings = Readings()
    console = Console(record=True, width=200)
    assert watch(readings, console, 0.5, rounds=3, sleep=slept.append) == 3
    assert (readings.calls, slept) == (3, [0.5, 0.5])
    assert "20.0" in console.export_text()  # 10 more requests in 0.5 s


def test_ctrl_c_stops_the_watch_quietly() -> None:
    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    assert watch(Readings(), Console(record=True), 1.0, sleep=interrupt) == 1


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
def test_an_interval_that_is_not_positive_is_refused(interval: float) -> None:
    with pytest.raises(InvalidInput, match="--interval must be a positive"):
        watch(Readings(), Console(record=True), interval, rounds=1)

