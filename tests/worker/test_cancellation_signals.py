"""How a worker learns its caller gave up: the caller watch, the stop signals, the counter."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import REGISTRY

from kvmesh.errors import InvalidInput, RequestCancelled, RequestExpired
from kvmesh.worker.cancellation import (
    CallerWatch,
    StopSignals,
    cancelled_count,
    count_cancelled,
    current_task_cancelled,
    request_deadline,
)

POLL_S = 0.005


class Jobs:
    """A fake GCS: which callers are dead, and how often each was asked about."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.asked: Counter[str] = Counter()
        self.broken = False
        self._lock = threading.Lock()

    def is_dead(self, caller: str) -> bool:
        with self._lock:
            self.asked[caller] += 1
            if self.broken:
                raise ConnectionError("GCS unreachable")
            return caller in self.dead

    def times_asked(self, caller: str) -> int:
        with self._lock:
            return self.asked[caller]


def wait_for(cond: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Poll `cond` until it holds or `timeout_s` passes (a bound on state, not a timing)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


@pytest.fixture
def jobs() -> Jobs:
    return Jobs()


@pytest.fixture
def watch(jobs: Jobs) -> Iterator[CallerWatch]:
    w = CallerWatch(jobs.is_dead, poll_s=POLL_S)
    yield w
    w.close()


def test_a_watched_caller_reads_gone_once_it_is_dead_and_the_others_stay_alive(
    jobs: Jobs, watch: CallerWatch
) -> None:
    with watch.watch("a") as a_gone, watch.watch("b") as b_gone:
        assert wait_for(lambda: jobs.times_asked("a") >= 2)
        assert not a_gone() and not b_gone()
        jobs.dead.add("a")
        assert wait_for(a_gone)
        assert wait_for(lambda: jobs.times_asked("b") >= jobs.times_asked("a") + 2)
        assert not b_gone()


def test_a_caller_is_asked_about_only_while_one_of_its_requests_runs(
    jobs: Jobs, watch: CallerWatch
) -> None:
    with watch.watch("short"):
        assert wait_for(lambda: jobs.times_asked("short") >= 1)
    asked = jobs.times_asked("short")
    with watch.watch("long"):
        assert wait_for(lambda: jobs.times_asked("long") >= 3)  # several polls went by
    assert jobs.times_asked("short") == asked


def test_two_requests_of_one_caller_share_its_fate_until_the_last_one_ends(
    jobs: Jobs, watch: CallerWatch
) -> None:
    with watch.watch("c") as first:
        with watch.watch("c") as second:
            jobs.dead.add("c")
            assert wait_for(lambda: first() and second())
        assert first()  # one request of the caller still runs: still gone


def test_a_failing_liveness_check_counts_the_caller_as_alive(
    jobs: Jobs, watch: CallerWatch
) -> None:
    jobs.broken = True
    jobs.dead.add("x")
    with watch.watch("x") as gone:
        assert wait_for(lambda: jobs.times_asked("x") >= 3)
        assert not gone()  # its deadline still bounds the request
        jobs.broken = False
        assert wait_for(gone)


def test_after_close_nothing_is_asked_and_requests_still_run(jobs: Jobs) -> None:
    watch = CallerWatch(jobs.is_dead, poll_s=POLL_S)
    with watch.watch("a"):
        assert wait_for(lambda: jobs.times_asked("a") >= 1)
    watch.close()
    asked = jobs.times_asked("a")
    jobs.dead.add("a")
    with watch.watch("a") as gone:
        assert not gone()
    assert jobs.times_asked("a") == asked


def test_stop_signals_say_which_reason_stopped_a_request() -> None:
    assert StopSignals().cancelled is None  # nothing can fire: the engine checks nothing
    flag, gone = [False], [False]
    signals = StopSignals(lambda: flag[0], lambda: gone[0])
    check = signals.cancelled
    assert check is not None and not check()
    flag[0] = True
    assert check()
    assert signals.reason(RequestCancelled("x")) == "cancelled"
    assert signals.reason(RequestExpired("x")) == "deadline"
    gone[0] = True
    assert signals.reason(RequestCancelled("x")) == "caller_gone"
    assert StopSignals(caller_gone=lambda: True).cancelled is not None


def test_cancelled_requests_are_counted_by_worker_and_reason() -> None:
    worker = f"w-{uuid.uuid4().hex[:8]}"
    count_cancelled(worker, "deadline")
    count_cancelled(worker, "caller_gone")
    count_cancelled(worker, "caller_gone")
    sample = REGISTRY.get_sample_value(
        "kvmesh_requests_cancelled_total", {"worker": worker, "reason": "caller_gone"}
    )
    assert sample == 2.0
    assert cancelled_count(worker) == 3
    assert cancelled_count(f"{worker}-other") == 0


def test_outside_a_ray_task_there_is_no_cancel_flag_to_read() -> None:
    assert current_task_cancelled() is None


def test_a_deadline_is_the_budget_counted_from_arrival_on_the_workers_clock() -> None:
    assert request_deadline(2.5, "02000000", lambda: 10.0) == 12.5
    assert request_deadline(None, None, lambda: 10.0) is None
    with pytest.raises(InvalidInput, match="timeout_s"):
        request_deadline(0, None, lambda: 10.0)
