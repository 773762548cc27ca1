"""Saves off the engine's critical path: a bounded queue and one thread that seals and sends.

`wait_for_save` runs at the end of every engine step, before the step's
tokens go out; sending a prompt's blocks to the store there would add the
save (tens of ms for a 1,000-token prompt, `kvmesh bench engines
--connector`) to the request's time to first token. So the step only copies
its blocks out of the KV cache (the engine may reuse the blocks once the
request ends; `BlockPath.stage`: into the store's staging slots, or bytes)
and hands them to `BackgroundSaver`, whose thread seals and saves them in
order (`BlockPath.send`). The queue is bounded: when the store falls behind,
new saves are dropped (a dropped save is a later miss, never a wrong
answer); blocks saved, dropped and failed are counted in
``kvmesh_connector_blocks``. `flush` waits until everything handed over was
sent (a prefill engine's hand-off, shutdown).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvmesh.connector.block_path import PendingSave
from kvmesh.errors import KVMeshError
from kvmesh.metrics import CONNECTOR_BLOCKS

log = logging.getLogger(__name__)

SendFn = Callable[[PendingSave], object]


class BackgroundSaver:
    """Sends `PendingSave`s on one daemon thread, in the order they were submitted.

    `send` seals and saves one (`BlockPath.send`); `release` gives back what a
    dropped one held (its staging slots).
    """

    def __init__(
        self,
        send: SendFn,
        *,
        release: Callable[[PendingSave], None] | None = None,
        store: str = "",
        max_pending: int = 64,
        on_error: Callable[[KVMeshError], None] | None = None,
    ) -> None:
        self._send_one = send
        self._release = release
        self._queue: queue.Queue[PendingSave | None] = queue.Queue(max_pending)
        self._on_error = on_error
        self._saved = CONNECTOR_BLOCKS.labels(store, "saved")
        self._dropped = CONNECTOR_BLOCKS.labels(store, "dropped")
        self._failed = CONNECTOR_BLOCKS.labels(store, "save_failed")
        self._thread = threading.Thread(target=self._run, name="kvmesh-saver", daemon=True)
        self._thread.start()

    def submit(self, pending: PendingSave) -> bool:
        """Queue a save; False (and counted) when the store is too far behind to take it."""
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            self.drop(pending)
            return False
        return True

    def drop(self, pending: PendingSave) -> None:
        """Count a save that will not be sent and give back what it held."""
        self._dropped.inc(len(pending.run))
        if self._release is not None:
            self._release(pending)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every save submitted so far was sent (or failed); False on timeout."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (within `timeout_s`) and stop the thread."""
        self.flush(timeout_s)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                if pending is None:
                    return
                self._send(pending)
            finally:
                self._queue.task_done()

    def _send(self, pending: PendingSave) -> None:
        try:
            self._send_one(pending)
            self._saved.inc(len(pending.run))
        except KVMeshError as exc:
            self._failed.inc(len(pending.run))
            if self._on_error is not None:
                self._on_error(exc)
        except Exception:  # a bug here must not kill the thread (and every later save)
            self._failed.inc(len(pending.run))
            log.exception("kvmesh connector: a save failed")
