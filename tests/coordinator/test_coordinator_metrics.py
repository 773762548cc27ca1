"""The coordinator counts in named metrics (kvmesh.metrics), and its stats read them back."""

from __future__ import annotations

import random

import pytest

from kvmesh import metrics
from kvmesh.config import CoordinatorConfig
from kvmesh.coordination import RouteQuery, WorkerReport
from kvmesh.coordinator.service import Coordinator
from kvmesh.errors import EventDecodeError
from tests.coordinator.pool_worker_kit import PoolWorker
from tests.coordinator.test_service import prompt


def served(coord: Coordinator, worker: PoolWorker, tag: int, pages: int = 3) -> None:
    worker.serve(prompt(pages, tag))
    coord.report(WorkerReport(worker.worker_id, [worker.batch()]))


def new_coordinator(**cfg: object) -> tuple[Coordinator, PoolWorker]:
    coord = Coordinator(CoordinatorConfig(**cfg), rng=random.Random(0))  # type: ignore[arg-type]
    w = PoolWorker("w0")
    w.register(coord)
    coord.report(WorkerReport(w.worker_id, [w.snapshot()]))
    return coord, w


def test_routes_are_counted_by_policy_and_worker_with_their_decision_time() -> None:
    coord, w = new_coordinator()
    served(coord, w, tag=1)
    for _ in range(3):
        coord.route(RouteQuery(prompt(3, 1), 12, page_size=4))
    me = coord.name
    assert metrics.ROUTES.value(coordinator=me, policy="kv_aware", worker="w0") == 3
    assert metrics.ROUTE_SECONDS.value(coordinator=me, policy="kv_aware") == 3
    assert metrics.PREDICTED_PAGES.value(coordinator=me, kind="local") == 3 * 3
    stats = coord.stats()
    assert (stats.routes, stats.routes_by_worker) == (3, {"w0": 3})
    assert stats.route_time_mean_us > 0


def test_predicted_and_realized_pages_and_mismatches_come_from_the_metrics() -> None:
    coord, _ = new_coordinator()
    assert not coord.record_result(2, 0, 2, 0)
    assert coord.record_result(3, 1, 1, 0)
    me = coord.name
    assert metrics.REALIZED_PAGES.value(coordinator=me, kind="local") == 3
    assert metrics.ROUTE_RESULTS.values_by("outcome", coordinator=me) == {"kept": 1, "mismatch": 1}
    stats = coord.stats()
    assert (stats.results_recorded, stats.mismatches, stats.realized_local_pages) == (2, 1, 3)


def test_event_batches_gaps_and_lag_are_counted_per_worker() -> None:
    coord, w = new_coordinator()
    served(coord, w, tag=1)
    w.serve(prompt(2, 2))
    w.batch()  # lost on the way: the next batch leaves a gap
    served(coord, w, tag=3)
    me = coord.name
    by_outcome = metrics.EVENT_BATCHES.values_by("outcome", coordinator=me, worker="w0")
    assert by_outcome == {"replaced": 1, "applied": 1, "stale": 1}
    assert metrics.EVENT_GAPS.value(coordinator=me, worker="w0") == 1
    assert metrics.EVENT_LAG.value(coordinator=me, worker="w0") == 3
    assert metrics.WORKERS.value(coordinator=me, state="stale") == 1
    assert coord.stats().batches_stale == 1


def test_a_rejected_report_counts_under_the_error_kind_and_changes_nothing() -> None:
    coord, w = new_coordinator()
    with pytest.raises(EventDecodeError):
        coord.report(WorkerReport(w.worker_id, [b"\x00not msgpack"]))
    me = coord.name
    assert metrics.COORDINATOR_ERRORS.value(coordinator=me, kind="EventDecodeError") == 1
    assert metrics.EVENT_BATCHES.value(coordinator=me, outcome="rejected") == 1
    with pytest.raises(EventDecodeError):
        coord.report(WorkerReport("someone", [b"\x00"]))  # type: ignore[arg-type]
    assert metrics.EVENT_BATCHES.value(coordinator=me, worker="unregistered") == 1
    assert coord.stats().batches_rejected == 2


def test_two_live_coordinators_of_one_name_count_apart() -> None:
    a, wa = new_coordinator()
    b, _ = new_coordinator()
    assert a.name != b.name
    served(a, wa, tag=1)
    a.route(RouteQuery(prompt(3, 1), 12, page_size=4))
    assert (a.stats().routes, b.stats().routes) == (1, 0)


def test_worker_gauges_follow_registration_draining_and_removal() -> None:
    coord, w = new_coordinator()
    me = coord.name
    assert metrics.WORKERS.value(coordinator=me, state="all") == 1
    coord.drain_worker(w.worker_id)
    assert metrics.WORKERS.value(coordinator=me, state="draining") == 1
    served(coord, w, tag=1)
    assert metrics.INDEXED_PAGES.value(coordinator=me) == 3
    coord.remove_worker(w.worker_id)
    assert metrics.WORKERS.value(coordinator=me, state="all") == 0
    assert metrics.INDEXED_PAGES.value(coordinator=me) == 0
