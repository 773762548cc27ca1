"""The worker registry: who is in the cluster, where, and how loaded.

Pure (no Ray, no gRPC) and not thread-safe (the coordinator service locks
around it). The clock is injected (`clock`, seconds, monotonic), and every
call that reads time also takes an explicit `now`, so expiry tests never sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvmesh.coordination import WorkerRegistration
from kvmesh.coordinator.policies import WorkerLoad
from kvmesh.errors import InvalidInput, UnknownWorker
from kvmesh.requests import Role
from kvmesh.types import WorkerId


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One registered worker, as of its last registration or heartbeat.

    `capacity` is its pool's page count; `actor_name` / `actor_namespace`
    name its Ray actor when it has one, so that a restarted coordinator can
    find it again and ask for a snapshot.
    """

    worker_id: WorkerId
    address: str
    capacity: int
    incarnation: str
    role: Role
    registered_at: float
    last_heartbeat: float
    load: WorkerLoad
    draining: bool = False
    actor_name: str | None = None
    actor_namespace: str | None = None

    @property
    def registration(self) -> WorkerRegistration:
        """What the worker registered with (to register it again elsewhere: a replica, a
        restarted coordinator)."""
        return WorkerRegistration(
            self.worker_id,
            self.address,
            self.capacity,
            self.incarnation,
            self.role,
            self.actor_name,
            self.actor_namespace,
        )

    def serves(self, role: Role | None) -> bool:
        """Whether this worker takes requests of `role` (None: any)."""
        return role is None or self.role == "both" or self.role == role


class WorkerRegistry:
    """Registered workers by id; expiry drops those whose heartbeat is too old."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._workers: dict[WorkerId, WorkerInfo] = {}

    def register(self, reg: WorkerRegistration, *, now: float | None = None) -> WorkerInfo:
        """Add or refresh a worker; a new incarnation replaces the old entry (drain flag cleared).

        Raises `InvalidInput` for a registration that does not check (it may have crossed
        a process boundary without its constructor running)."""
        reg.check()
        worker_id, capacity, incarnation = reg.worker_id, reg.capacity, reg.incarnation
        t = self.clock() if now is None else now
        old = self._workers.get(worker_id)
        same = old is not None and old.incarnation == incarnation
        load = (
            old.load
            if same and old is not None
            else WorkerLoad(worker_id, free_pages=capacity, total_pages=capacity)
        )
        info = WorkerInfo(
            worker_id,
            reg.address,
            capacity,
            incarnation,
            reg.role,
            old.registered_at if same and old is not None else t,
            t,
            load,
            old.draining if same and old is not None else False,
            reg.actor_name,
            reg.actor_namespace,
        )
        self._workers[worker_id] = info
        return info

    def heartbeat(
        self, worker_id: WorkerId, load: WorkerLoad | None = None, now: float | None = None
    ) -> WorkerInfo:
        """Record that `worker_id` is alive (and its load); raises `UnknownWorker` if not registered."""
        info = self.get(worker_id)
        t = self.clock() if now is None else now
        if load is not None and load.worker_id != worker_id:
            raise InvalidInput(f"load of {load.worker_id!r} reported by {worker_id!r}")
        info = replace(info, last_heartbeat=t, load=info.load if load is None else load)
        self._workers[worker_id] = info
        return info

    def routed(self, worker_id: WorkerId, prefill_tokens: int) -> WorkerLoad | None:
        """Add a request just routed to `worker_id` to its load, until its next report
        replaces the load with what it measured; returns the new load (None: unknown).

        The router thus weighs the work it sent at once, without the worker
        telling it (one call less per request)."""
        info = self._workers.get(worker_id)
        if info is None:
            return None
        load = replace(
            info.load,
            active_prefill_tokens=info.load.active_prefill_tokens + max(0, prefill_tokens),
            active_requests=info.load.active_requests + 1,
        )
        self._workers[worker_id] = replace(info, load=load)
        return load

    def expire(self, now: float | None = None, timeout: float = 5.0) -> list[WorkerId]:
        """Drop and return the workers whose last heartbeat is older than `timeout` seconds."""
        t = self.clock() if now is None else now
        dead = sorted(w for w, info in self._workers.items() if t - info.last_heartbeat > timeout)
        for w in dead:
            del self._workers[w]
        return dead

    def drain(self, worker_id: WorkerId, draining: bool = True) -> WorkerInfo:
        """Stop sending new requests to `worker_id` unless nothing else is left."""
        info = replace(self.get(worker_id), draining=draining)
        self._workers[worker_id] = info
        return info

    def remove(self, worker_id: WorkerId) -> WorkerInfo | None:
        return self._workers.pop(worker_id, None)

    def get(self, worker_id: WorkerId) -> WorkerInfo:
        info = self._workers.get(worker_id)
        if info is None:
            raise UnknownWorker(
                f"worker {worker_id!r} is not registered (expired or coordinator restarted): "
                "register it again"
            )
        return info

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Registered workers serving `role`, by id."""
        return [self._workers[w] for w in sorted(self._workers) if self._workers[w].serves(role)]
