"""How a worker learns that the caller of a running request has given up.

`ServingEngine.serve` asks one `cancelled()` callable before each prefill chunk
and decode step (and while the request waits for a slot), and stops the
request when it says True. This module builds that callable from the two
signals a Ray worker can see; the third, the deadline, travels with the request
(`GenerateRequest.timeout_s`) and the engine checks it itself::

    client awaits ─ cancelled / timed out ─► ray.cancel(ref) ─► task flag    (current_task_cancelled)
    client process dies ─────────────────► its Ray job dead ─► CallerWatch  (caller_gone)
    nobody says anything ────────────────► timeout_s passes  ─► engine deadline

Why each is needed (Ray 2.60, read in its source and measured): for a task of
a threaded (sync) actor `ray.cancel` never interrupts the thread, it only
sets a flag the task reads with ``ray.get_runtime_context().is_canceled()``
(from the task's own thread; another task running beside it is not
affected). An `asyncio.wait_for` that times out on an object ref does not
cancel the task at all. A caller process that dies cannot call `ray.cancel`,
and Ray lets its in-flight actor tasks run to their end; but the GCS marks
its driver's job dead at once (about 0.1 s after ``os._exit`` here), which
`CallerWatch` polls for the jobs of the requests in flight.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from prometheus_client import REGISTRY

from kvmesh.errors import InvalidInput, RequestCancelled, RequestExpired
from kvmesh.metrics import REQUESTS_CANCELLED

log = logging.getLogger(__name__)

CALLER_POLL_S = 0.5
"""How often a worker asks the GCS whether the callers of its in-flight requests still live."""

GCS_TIMEOUT_S = 5.0

CANCEL_REASONS: Final = ("cancelled", "deadline", "caller_gone")
"""The `reason` label of `kvmesh_requests_cancelled_total`."""


def request_deadline(
    timeout_s: object, caller_job: object, clock: Callable[[], float]
) -> float | None:
    """The time on `clock` at which a request that arrived now must stop (None: never).

    Raises `InvalidInput` for a `timeout_s` that is not a positive number of
    seconds or a `caller_job` that is not a string, before any work starts.
    """
    if caller_job is not None and not isinstance(caller_job, str):
        raise InvalidInput(f"caller_job must be a Ray job id string or None, got {caller_job!r}")
    if timeout_s is None:
        return None
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise InvalidInput(
            f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}"
        )
    return clock() + timeout_s


def current_task_cancelled() -> Callable[[], bool] | None:
    """The `ray.cancel` flag of the Ray task running on this thread, as a callable.

    None outside a sync Ray actor task (a driver, e.g. a worker built in a test
    process, or no Ray at all): there is nothing that could cancel it.
    """
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    try:
        context.is_canceled()
    except RuntimeError:  # a driver, or an async actor (which Ray cancels by itself)
        return None
    return context.is_canceled


def ray_job_is_dead(job_id: str) -> bool:
    """Whether the GCS marks Ray job `job_id` (hex) dead: its driver has exited.

    Ray 2.60 offers job liveness without the dashboard only through the GCS
    client Ray's own autoscaler uses; an unknown job counts as alive.
    """
    import ray

    gcs = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]  # set on connect
    jobs = gcs.get_all_job_info(
        job_or_submission_id=job_id,
        skip_submission_job_info_field=True,
        skip_is_running_tasks_field=True,
        timeout=GCS_TIMEOUT_S,
    )
    return any(job.is_dead for job in jobs.values())


class CallerWatch:
    """Knows which callers of the requests in flight are gone; thread-safe.

    `watch(caller)` registers a request's caller for as long as the request
    runs and yields a callable that turns True once `is_dead(caller)` has said
    so. One daemon thread asks `is_dead` for every watched caller each
    `poll_s`, and sleeps while nothing is watched. A failing `is_dead` counts
    as alive (the request's deadline still bounds it) and is logged.
    """

    def __init__(self, is_dead: Callable[[str], bool], poll_s: float = CALLER_POLL_S) -> None:
        self._is_dead = is_dead
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._watched: Counter[str] = Counter()
        self._gone: frozenset[str] = frozenset()  # replaced whole, so readers take no lock
        self._closed = False
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(self, caller: str) -> Iterator[Callable[[], bool]]:
        """Watch `caller` while the block runs; yields "is it gone?". After `close`, never."""
        with self._cond:
            closed = self._closed
            if not closed:
                self._watched[caller] += 1
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="kvmesh-caller-watch", daemon=True
                    )
                    self._thread.start()
                self._cond.notify_all()
        if closed:  # the worker is shutting down: the request's deadline still bounds it
            yield lambda: False
            return
        try:
            yield lambda: caller in self._gone
        finally:
            with self._cond:
                self._watched[caller] -= 1
                if self._watched[caller] <= 0:
                    del self._watched[caller]
                    self._gone = self._gone - {caller}

    def close(self) -> None:
        """Stop the polling thread (requests still watched are no longer checked)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=GCS_TIMEOUT_S + 1)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._watched))
                if self._closed:
                    return
                callers = [c for c in self._watched if c not in self._gone]
            dead = {c for c in callers if self._asks_dead(c)}
            with self._cond:
                if dead:
                    self._gone = self._gone | (dead & self._watched.keys())
                if self._cond.wait_for(lambda: self._closed, timeout=self._poll_s):
                    return

    def _asks_dead(self, caller: str) -> bool:
        try:
            return self._is_dead(caller)
        except Exception as exc:  # fail open: the deadline still stops the request
            log.warning("could not tell whether caller %s is alive: %s", caller, exc)
            return False


@dataclass(frozen=True, slots=True)
class StopSignals:
    """A request's `cancelled()` for the engine: its task was cancelled or its caller is gone."""

    task_cancelled: Callable[[], bool] | None = None
    caller_gone: Callable[[], bool] | None = None

    @property
    def cancelled(self) -> Callable[[], bool] | None:
        """What `ServingEngine.serve` asks; None when neither signal can fire."""
        if self.task_cancelled is None and self.caller_gone is None:
            return None
        return self._any

    def _any(self) -> bool:
        return bool(
            (self.caller_gone is not None and self.caller_gone())
            or (self.task_cancelled is not None and self.task_cancelled())
        )

    def reason(self, error: RequestCancelled) -> str:
        """Which of `CANCEL_REASONS` stopped the request that raised `error`."""
        if isinstance(error, RequestExpired):
            return "deadline"
        if self.caller_gone is not None and self.caller_gone():
            return "caller_gone"
        return "cancelled"


def count_cancelled(worker_id: str, reason: str) -> None:
    REQUESTS_CANCELLED.labels(worker=worker_id, reason=reason).inc()


def cancelled_count(worker_id: str) -> int:
    """Requests `worker_id` stopped before answering, all reasons (this process's counter)."""
    total = 0.0
    for reason in CANCEL_REASONS:
        labels = {"worker": worker_id, "reason": reason}
        total += REGISTRY.get_sample_value("kvmesh_requests_cancelled_total", labels) or 0.0
    return int(total)
