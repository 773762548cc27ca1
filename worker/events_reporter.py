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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvmesh.errors import InvariantViolation, UnknownWorker
from kvmesh.events import encode_batch, make_batch
from kvmesh.load import WorkerLoad
from kvmesh.types import WorkerId

if TYPE_CHECKING:
    from kvmesh.worker.page_service import PageService

log = logging.getLogger(__name__)


def remote_cause(exc: BaseException) -> BaseException:
    """The original exception of a Ray task error (Ray wraps remote exceptions)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class CoordinatorRpc:
    """Calls on the coordinator: a Ray actor handle, awaited up to `timeout_s` unless the
    caller does not wait, or, in one process (tests, tools), a plain `Coordinator`."""

    __slots__ = ("coordinator", "timeout_s")

    def __init__(self, coordinator: Any, timeout_s: float) -> None:
        self.coordinator = coordinator
        self.timeout_s = timeout_s

    def __call__(self, method: str, *args: Any, wait: bool = True, **kwargs: Any) -> Any:
        fn = getattr(self.coordinator, method)
        remote = getattr(fn, "remote", None)
        if remote is None:
            return fn(*args, **kwargs)
        ref = remote(*args, **kwargs)
        if not wait:
            return None
        import ray  # only a worker inside Ray gets a handle; tools and tests need no Ray

        return ray.get(ref, timeout=self.timeout_s)


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
        self._needs_snapshot = True  # the first report carries the whole (empty) cached set
        self.batches_sent = 0
        self.snapshots_sent = 0
        self._stop = threading.Event()
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
        """Report queued events and the load now; True when acknowledged.

        Raises nothing when the coordinator is away: the batches stay queued and
        go out (again) with the next report.
        """
        if self._rpc is None:
            self._pages.take_events()
            return False
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
            batches = list(self._unacked)
            try:
                reply = self._rpc("report", self.worker_id, batches, self._load())
            except Exception as exc:
                cause = remote_cause(exc)
                if isinstance(cause, UnknownWorker):  # expired, or the coordinator lost us
                    self._needs_snapshot = True
                    try:
                        self.register()
                    except Exception as again:
                        log.warning("re-registering failed (will retry): %s", remote_cause(again))
                else:
                    log.warning("report to the coordinator failed (will resend): %s", cause)
                return False
            self._unacked.clear()
            self.batches_sent += len(batches)
            if reply.needs_snapshot:
                self._needs_snapshot = True
            return True

    def flush_quietly(self) -> None:
        """`flush`, logging instead of raising: reporting must never fail a request."""
        try:
            self.flush()
        except Exception:
            log.exception("flushing events failed")

    def announce(self, load: WorkerLoad) -> None:
        """Tell the coordinator `load` without waiting (best effort): routing weighs
        queued prefill work, which it would otherwise learn of only after it ended."""
        if self._rpc is None:
            return
        try:
            self._rpc("heartbeat", self.worker_id, load, wait=False)
        except Exception as exc:
            log.warning("load announcement failed: %s", remote_cause(exc))

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
        while not self._stop.wait(self._interval_s):
            self.flush_quietly()


__all__ = ["CoordinatorRpc", "EventReporter", "remote_cause"]
