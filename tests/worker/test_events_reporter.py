"""EventReporter.report_request: the one call a request costs its worker, never waited for.

The coordinator here stands behind a Ray-like handle whose replies the test
holds back (`HeldCoordinator`: ``method.remote(...)`` returns a ref whose
``future()`` the test completes), so the tests see what is sent, in which
order, and that the request path returns while the reply is still pending.
Behind it is the real `Coordinator` and a real pool.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from kvmesh.config import CoordinatorConfig
from kvmesh.coordination import WorkerRegistration
from kvmesh.coordinator.service import Coordinator
from kvmesh.errors import UnknownWorker
from kvmesh.events import decode_batch
from kvmesh.hashing import PageHasher
from kvmesh.load import WorkerLoad
from kvmesh.requests import RouteOutcome
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.events_reporter import CoordinatorRpc, EventReporter
from kvmesh.worker.kv_store import KVStore
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import PageService

PAGE = 4
WID = WorkerId("w0")


class _Ref:
    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    def future(self) -> Future[Any]:
        return self._future


class _Method:
    def __init__(self, owner: HeldCoordinator, name: str) -> None:
        self.owner, self.name = owner, name

    def remote(self, *args: Any) -> _Ref:
        future: Future[Any] = Future()
        self.owner.sent.append((self.name, args, future))
        return _Ref(future)


class HeldCoordinator:
    """A Ray-like handle on a real `Coordinator`: calls queue until `answer` runs them."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core
        self.sent: list[tuple[str, tuple[Any, ...], Future[Any]]] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    def answer(self) -> None:
        """Run every queued call on the core, in the order sent, and deliver its reply."""
        queued, self.sent = self.sent, []
        for name, args, future in queued:
            try:
                future.set_result(getattr(self.core, name)(*args))
            except Exception as exc:
                future.set_exception(exc)


def register(core: Coordinator) -> None:
    core.register_worker(WorkerRegistration(WID, "127.0.0.1:1", 15, "inc-1"))


def setup() -> tuple[HeldCoordinator, EventReporter, PagePool]:
    core = Coordinator(CoordinatorConfig())
    register(core)
    held = HeldCoordinator(core)
    pool = PagePool(16, page_size=PAGE)
    pages = PageService(pool, KVStore(16, 1, 1, 4, PAGE), PageHasher(PAGE))
    reporter = EventReporter(
        WID,
        "inc-1",
        pages,
        rpc=CoordinatorRpc(held, timeout_s=5.0),
        register=lambda: register(core),
        load=lambda: WorkerLoad(WID),
        interval_s=3600.0,
    )
    return held, reporter, pool


def cache(pool: PagePool, n: int, tag: int) -> list[PageHash]:
    hashes = PageHasher(PAGE).hash_prompt([tag] * (n * PAGE))
    pages = pool.get_new_pages(n)
    pool.cache_full_pages(pages, hashes, 0, n)
    pool.free_pages(list(reversed(pages)))
    return hashes


def test_a_requests_report_is_sent_at_once_and_not_waited_for() -> None:
    held, reporter, pool = setup()
    hashes = cache(pool, 2, tag=1)
    reporter.report_request(RouteOutcome(0, 0, 0, 0))  # returns with the reply pending
    ((name, args, future),) = held.sent
    assert name == "report" and not future.done()
    (report,) = args
    assert report.worker_id == WID and report.outcomes == (RouteOutcome(0, 0, 0, 0),)
    assert decode_batch(report.batches[0]).snapshot  # the first report carries the whole cached set
    held.answer()
    assert held.core.match(hashes).pages == {WID: 2}
    assert reporter.batches_sent == 1


def test_reports_go_out_in_seq_order_and_an_unacknowledged_batch_goes_again() -> None:
    held, reporter, pool = setup()
    reporter.report_request()
    cache(pool, 1, tag=2)
    reporter.report_request(RouteOutcome(1, 0, 1, 0))
    first, second = (args[0].batches for _, args, _ in held.sent)
    assert [decode_batch(b).seq for b in first] == [0]
    assert [decode_batch(b).seq for b in second] == [0, 1]  # batch 0 not acknowledged yet
    held.answer()  # the coordinator ignores batch 0 the second time
    assert held.core.stats().batches_stale == 0
    assert held.core.stats().results_recorded == 1  # each outcome is sent once


def test_a_failed_reports_outcomes_go_with_the_next_report() -> None:
    held, reporter, _ = setup()
    reporter.report_request(RouteOutcome(2, 0, 1, 0))
    ((_, _, future),) = held.sent
    held.sent.clear()
    future.set_exception(ConnectionError("the coordinator is restarting"))
    reporter.report_request()
    ((_, args, _),) = held.sent
    assert args[0].outcomes == (RouteOutcome(2, 0, 1, 0),)
    held.answer()
    assert held.core.stats().mismatches == 1


def test_an_unknown_worker_seen_in_the_background_registers_and_resyncs_on_the_next_flush() -> None:
    held, reporter, pool = setup()
    reporter.report_request()
    ((_, _, future),) = held.sent
    held.sent.clear()
    held.core.remove_worker(WID)  # e.g. it missed its heartbeats
    future.set_exception(UnknownWorker("w0 is not registered"))
    hashes = cache(pool, 1, tag=3)
    flushed: list[bool] = []
    heartbeat = threading.Thread(target=lambda: flushed.append(reporter.flush()))
    heartbeat.start()
    while not held.sent:
        heartbeat.join(0.01)
    ((_, args, _),) = held.sent
    assert [decode_batch(b).snapshot for b in args[0].batches] == [True]
    held.answer()
    heartbeat.join(5)
    assert flushed == [True] and WID in held.core.registry
    assert held.core.match(hashes).pages == {WID: 1}
