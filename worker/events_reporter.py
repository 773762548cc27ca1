"""A worker's report to the coordinator: its pool's events in ordered batches, and its load.

Every change of the pool's cached set is drained into a batch
(`kvmesh.events.encode_batch`: worker id, a fresh incarnation per start,
seq 0, 1, 2, ... from one counter) and reported every heartbeat interval
and right after each request, so the index is fresh for the next route. A
batch stays queued until the coordinator has acknowledged it (a report that
failed is resent; the coordinator ignores duplicates). When the coordinator
says the worker is stale or unknown, the next report carries a snapshot
batch (the whole cached set) instead; `snapshot` serves the same batch to a
restarting coordinator. Every batch, snapshot or not, takes the next seq
under one lock, so the coordinator sees one ordered stream.

The report after a request (`report_request`) is the one coordinator call a
request costs its worker, and the answer never waits for it: it is sent
(in order, under the lock) before the answer leaves and acknowledged in the
background. It also carries the request's `RouteOutcome` (promised vs
reused pages), sent once; an outcome whose report failed goes with the next.
The lock is never held while a reply is awaited, so a slow coordinator
delays the heartbeat thread, not a request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvmesh.coordination import WorkerReport
from kvmesh.errors import InvariantViolation, UnknownWorker
from kvmesh.events import encode_batch, make_batch
from kvmesh.handles import ReportReply, WorkerCoordinator
from kvmesh.load import WorkerLoad
from kvmesh.requests import RouteOutcome
from kvmesh.types import WorkerId

if TYPE_CHECKING:
    from kvmesh.worker.page_service import PageService

log = logging.getLogger(__name__)


def remote_cause(exc: BaseException) -> BaseException:
    """The original exception of a Ray task error (Ray wraps remote exceptions)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class CoordinatorRpc:
    """Calls on the coordinator: a Ray actor handle, awaited up to `timeout_s`, or, in one
    process (tests, tools), a plain `Coordinator`, called at once."""

    __slots__ = ("coordinator", "timeout_s")

    def __init__(self, coordinator: WorkerCoordinator, timeout_s: float) -> None:
        self.coordinator = coordinator
        self.timeout_s = timeout_s

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.coordinator, method)
        remote = getattr(fn, "remote", None)
        if remote is None:
            return fn(*args, **kwargs)
        import ray  # only a worker inside Ray gets a handle; tools and tests need no Ray

        return ray.get(remote(*args, **kwargs), timeout=self.timeout_s)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Future[Any]:
        """Send the call now without waiting; its reply (or error) comes in the future.

        Ray runs one caller's calls on an actor in the order they were sent, so
        calls submitted under one lock arrive in that order. In one process the
        call is made here and the future is already done.
        """
        fn = getattr(self.coordinator, method)
        remote = getattr(fn, "remote", None)
        if remote is not None:
            future: Future[Any] = remote(*args, **kwargs).future()
            return future
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except Exception as exc:
            done.set_exception(exc)
        return done


class EventReporter:
    """Batches a pool's events, numbers them and reports them with the worker's load.

    `rpc` None: no coordinator (events are drained and dropped). `register`
    (re)registers the worker; it is called again when the coordinator no
    longer knows it, and the next report is then a snapshot. `load` is the
    worker's load now. Thread-safe.
    """

    def __init__(
        self,
        worker_id: WorkerId,
        incarnation: str,
        pages: PageService,
        *,
        rpc: CoordinatorRpc | None,
        register: Callable[[], None],
        load: Callable[[], WorkerLoad],
        interval_s: float,
    ) -> None:
        self.worker_id = worker_id
        self.incarnation = incarnation
        self._pages = pages
        self._rpc = rpc
        self._register = register
        self._load = load
        self._interval_s = interval_s
        self._lock = threading.Lock()  # seqs are handed out in order under it
        self._next_seq = 0
        self._unacked: list[bytes] = []
        self._outcomes: list[RouteOutcome] = []  # not sent yet (or their report failed)
        self._needs_snapshot = True  # the first report carries the whole (empty) cached set
        self._register_due = False  # a background report found the worker unknown
        self.batches_sent = 0
        self.snapshots_sent = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name=f"kvmesh-heartbeat-{worker_id}", daemon=True
        )

    @property
    def last_seq(self) -> int:
        """The seq of the last batch built (-1: none yet)."""
        return self._next_seq - 1

    def register(self) -> None:
        """Register with the coordinator; the next report is a snapshot."""
        if self._rpc is None:
            return
        self._register()
        self._needs_snapshot = True

    def start(self) -> None:
        """Report every `interval_s` from a daemon thread until `stop`."""
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def snapshot(self) -> bytes:
        """A snapshot batch of the whole cached set, taking the next seq (for a coordinator
        rebuild). Queued batches are dropped: their effects are in the snapshot."""
        with self._lock:
            self._unacked.clear()
            self.snapshots_sent += 1
            data = self._batch(snapshot=True)
            if data is None:  # pragma: no cover - a snapshot batch is always built
                raise InvariantViolation("snapshot batch was not built")
            return data

    def flush(self) -> bool:
        """Report queued events, outcomes and the load now; True when acknowledged.

        Raises nothing when the coordinator is away: the batches stay queued and
        go out (again) with the next report. Registers again first if a
        background report found this worker unknown, and when this one does.
        """
        if self._rpc is None:
            self._pages.take_events()
            return False
        if self._register_due:
            self._register_again()
        sent = self._submit()
        if sent is None:
            return False
        future, batches, outcomes = sent
        try:
            reply = future.result(timeout=self._rpc.timeout_s)
        except Exception as exc:
            self._failed(exc, outcomes, register_now=True)
            return False
        self._settle(batches, reply)
        return True

    def flush_quietly(self) -> None:
        """`flush`, logging instead of raising: reporting must never fail a request."""
        try:
            self.flush()
        except Exception:
            log.exception("flushing events failed")

    def report_request(self, outcome: RouteOutcome | None = None) -> None:
        """Report what a request changed, and its `outcome`, without waiting for the reply.

        The call is sent before this returns (so before the answer leaves, and
        the next route sees the request's pages) and acknowledged in the
        background; a failure is logged and what it carried goes with the next
        report. Never raises: reporting must never fail a request.
        """
        if self._rpc is None:
            self._pages.take_events()
            return
        try:
            with self._lock:
                if outcome is not None:
                    self._outcomes.append(outcome)
            sent = self._submit()
            if sent is None:
                return
            future, batches, outcomes = sent
            future.add_done_callback(lambda done: self._acknowledged(done, batches, outcomes))
        except Exception:
            log.exception("reporting a request's events failed")

    def _submit(self) -> tuple[Future[ReportReply], list[bytes], list[RouteOutcome]] | None:
        """Build the next batch and send every unacknowledged one with the queued outcomes;
        None when sending failed at once (logged; everything stays queued)."""
        if self._rpc is None:  # pragma: no cover - callers check
            return None
        with self._lock:
            if self._needs_snapshot:
                self._unacked.clear()  # the snapshot covers them
                data = self._batch(snapshot=True)
                self.snapshots_sent += 1
                self._needs_snapshot = False
            else:
                data = self._batch(snapshot=False)
            if data is not None:
                self._unacked.append(data)
            batches, outcomes = list(self._unacked), self._outcomes
            self._outcomes = []
            try:
                report = WorkerReport(self.worker_id, tuple(batches), self._load(), tuple(outcomes))
                future = self._rpc.submit("report", report)
            except Exception as exc:
                self._outcomes[:0] = outcomes
                log.warning("report to the coordinator failed (will resend): %s", exc)
                return None
        return future, batches, outcomes

    def _acknowledged(
        self, done: Future[ReportReply], batches: list[bytes], outcomes: list[RouteOutcome]
    ) -> None:
        """The reply to a `report_request`, on whatever thread delivered it."""
        try:
            reply = done.result()
        except Exception as exc:
            self._failed(exc, outcomes, register_now=False)
            return
        self._settle(batches, reply)

    def _settle(self, batches: Sequence[bytes], reply: ReportReply) -> None:
        """An acknowledged report: its batches leave the queue; a stale index asks a snapshot."""
        with self._lock:
            acked = {id(b) for b in batches}
            self._unacked = [b for b in self._unacked if id(b) not in acked]
            self.batches_sent += len(batches)
            if reply.needs_snapshot:
                self._needs_snapshot = True

    def _failed(
        self, exc: BaseException, outcomes: Sequence[RouteOutcome], *, register_now: bool
    ) -> None:
        """A report that failed: its outcomes wait for the next; an unknown worker registers
        again (now, or from the heartbeat thread, woken, when a reply thread saw it)."""
        with self._lock:
            self._outcomes[:0] = outcomes
        cause = remote_cause(exc)
        if not isinstance(cause, UnknownWorker):  # expired, or the coordinator lost us
            log.warning("report to the coordinator failed (will resend): %s", cause)
            return
        self._needs_snapshot = True
        self._register_due = True
        if register_now:
            self._register_again()
        else:
            self._wake.set()

    def _register_again(self) -> None:
        try:
            self.register()
            self._register_due = False
        except Exception as again:
            log.warning("re-registering failed (will retry): %s", remote_cause(again))

    def _batch(self, snapshot: bool) -> bytes | None:
        """Drain events into the next batch; a snapshot batch carries the whole cached set.

        None (and no seq used) when there is no event and no snapshot is asked for.
        """
        pages = self._pages
        with pages.lock:
            events = pages.pool.take_events()
            snap = pages.pool.snapshot_events() if snapshot else []
        pages.observe(events)
        if not snapshot and not events:
            return None
        batch = make_batch(
            snap if snapshot else events,
            self.worker_id,
            self.incarnation,
            self._next_seq,
            snapshot=snapshot,
        )
        self._next_seq += 1
        return encode_batch(batch)

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.flush_quietly()


__all__ = ["CoordinatorRpc", "EventReporter", "remote_cause"]
