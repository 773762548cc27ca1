"""The coordinator as a plain thread-safe class: index + registry + policy + stats.

No Ray here: `kvmesh.coordinator.actor` wraps this class in a Ray actor, and
tests, the simulator and a gRPC front end can use it directly. One lock
guards everything; every public method takes it once.

What the coordinator needs from a worker
----------------------------------------
Only two things, both in `kvmesh` types:

- it calls `register_worker(...)` once per incarnation, then `report(worker_id,
  batches, load)` every heartbeat interval with its encoded event batches
  (`kvmesh.events.encode_batch`, sequence numbers from 0 per incarnation);
  `UnknownWorker` from `report` means "register again" (the coordinator
  expired it or restarted); a reply with `needs_snapshot` means "send a
  snapshot batch next";
- for rebuilding, a handle satisfying `SnapshotSource`: a `snapshot()` method
  returning the bytes of ``encode_batch(make_batch(pool.snapshot_events(),
  worker_id, incarnation, seq, snapshot=True))``, where `seq` is the seq of
  the last batch the worker has sent (its effects are in the snapshot;
  events not yet sent go out later with higher seqs, and re-applying them is
  harmless) or a fresh one the worker consumes. On Ray the handle is the
  worker's actor handle and the call is ``await handle.snapshot.remote()``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.index import ApplyResult, GlobalIndex, MatchResult
from kvmesh.coordinator.policies import (
    REGISTRY,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
    make_policy,
)
from kvmesh.coordinator.registry import WorkerInfo, WorkerRegistry
from kvmesh.errors import EventDecodeError, InvalidInput, KVMeshError, UnknownWorker
from kvmesh.events import EventBatch, decode_batch
from kvmesh.rendezvous import DistRendezvous, LinkBook, LinkEnd
from kvmesh.requests import Role
from kvmesh.types import PageHash, WorkerId


class SnapshotSource(Protocol):
    """A worker handle the coordinator can ask for its whole cached set (see the module docstring)."""

    def snapshot(self) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Registration:
    """Reply to `register_worker`: when to heartbeat and whether to send a snapshot batch first."""

    worker_id: WorkerId
    incarnation: str
    needs_snapshot: bool
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


@dataclass(frozen=True, slots=True)
class ReportResult:
    """Reply to `report`: what happened to each batch, and whether a snapshot is wanted."""

    results: tuple[ApplyResult, ...]
    needs_snapshot: bool


@dataclass(frozen=True, slots=True)
class RebuildResult:
    """Outcome of `rebuild_from_snapshots`: applied per worker, and why others failed."""

    applied: dict[WorkerId, ApplyResult]
    failed: dict[WorkerId, str]


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    """Counters since start (`as_dict` for JSON / Prometheus)."""

    workers: int
    stale_workers: int
    draining_workers: int
    indexed_pages: int
    index_entries: int
    routes: int
    route_time_mean_us: float
    degraded_routes: int
    routes_by_worker: dict[str, int]
    batches_applied: int
    batches_replaced: int
    batches_ignored: int
    batches_stale: int
    batches_rejected: int
    workers_expired: int
    promised_local_pages: int
    promised_pull_pages: int
    realized_local_pages: int
    realized_pull_pages: int
    results_recorded: int
    mismatches: int
    links_opened: int = 0  # torch.distributed links handed out (`open_link`)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RouteView:
    """What a policy decides from: each worker's held prefix and every candidate's load.

    `loads` is in worker-id order (the order policies break ties in); a
    sharded router merges one view per shard (`kvmesh.coordinator.shards`).
    """

    overlaps: dict[WorkerId, int]
    loads: tuple[WorkerLoad, ...]


class Coordinator:
    """Thread-safe coordinator core; see the module docstring for the worker side.

    `clock` (monotonic seconds) drives heartbeat expiry; `rng` drives every
    random choice of the policies, so a seeded run is repeatable.
    """

    def __init__(
        self,
        config: CoordinatorConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or CoordinatorConfig()
        self.clock = clock
        self._rng = rng if rng is not None else random.Random(self.config.seed)
        self._lock = threading.RLock()
        self.index = GlobalIndex(
            require_registration=True,
            default_tier=self.config.default_tier,
            reorder_window=self.config.reorder_window,
        )
        self.registry = WorkerRegistry(clock)
        self._policies: dict[str, RoutingPolicy] = {
            self.config.policy: make_policy(self.config.policy, self.config, self._rng)
        }
        self._loads: dict[Role | None, list[WorkerLoad]] = {}
        self._counts: Counter[str] = Counter()
        self._by_worker: Counter[str] = Counter()
        self._route_ns = 0

    # ---------------------------------------------------------------- workers

    def register_worker(
        self,
        worker_id: WorkerId,
        address: str,
        capacity: int,
        incarnation: str,
        role: Role = "both",
        *,
        actor_name: str | None = None,
        actor_namespace: str | None = None,
    ) -> Registration:
        """Add (or refresh) a worker. A new incarnation drops the old one's index entries."""
        with self._lock:
            self.registry.register(
                worker_id,
                address,
                capacity,
                incarnation,
                role,
                actor_name=actor_name,
                actor_namespace=actor_namespace,
            )
            self.index.register_worker(worker_id, incarnation)
            self._loads.clear()
            state = self.index.worker_state(worker_id)
            return Registration(
                worker_id,
                incarnation,
                state.last_seq < 0 or state.stale,
                self.config.heartbeat_interval_s,
                self.config.heartbeat_timeout_s,
            )

    def report(
        self,
        worker_id: WorkerId,
        encoded_batches: Sequence[bytes] = (),
        load: WorkerLoad | None = None,
    ) -> ReportResult:
        """Heartbeat plus event batches, applied in order.

        Every batch is decoded and checked (it must come from `worker_id`)
        before any is applied, so a bad one rejects the whole report with
        `EventDecodeError` and changes nothing. Batches of another incarnation
        than the registered one are ignored. Raises `UnknownWorker` when the
        worker must register again.
        """
        decoded: list[EventBatch] = []
        try:
            for data in encoded_batches:
                batch = decode_batch(data)
                if batch.worker_id != worker_id:
                    raise EventDecodeError(
                        f"worker {worker_id!r} reported a batch of {batch.worker_id!r}"
                    )
                decoded.append(batch)
        except EventDecodeError:
            with self._lock:
                self._counts["batches_rejected"] += len(encoded_batches)
            raise
        with self._lock:
            info = self.registry.heartbeat(worker_id, load)
            results: list[ApplyResult] = []
            for batch in decoded:
                if batch.incarnation != info.incarnation:
                    results.append(ApplyResult.IGNORED)
                else:
                    results.append(self.index.apply(batch))
                self._counts[f"batches_{results[-1].value}"] += 1
            self._loads.clear()
            return ReportResult(tuple(results), self.index.is_stale(worker_id))

    def heartbeat(self, worker_id: WorkerId, load: WorkerLoad | None = None) -> ReportResult:
        """A report without events."""
        return self.report(worker_id, (), load)

    def drain_worker(self, worker_id: WorkerId, draining: bool = True) -> None:
        with self._lock:
            self.registry.drain(worker_id, draining)
            self._loads.clear()

    def remove_worker(self, worker_id: WorkerId) -> bool:
        """Forget a worker and drop its index entries; False if it was not known."""
        with self._lock:
            known = self.registry.remove(worker_id) is not None
            dropped = worker_id in self.index.workers()
            self.index.remove_worker(worker_id)
            self._loads.clear()
            return known or dropped

    def expire(self, now: float | None = None) -> list[WorkerId]:
        """Remove the workers that missed heartbeats for `heartbeat_timeout_s`."""
        with self._lock:
            dead = self.registry.expire(now, self.config.heartbeat_timeout_s)
            for w in dead:
                self.index.remove_worker(w)
            if dead:
                self._counts["workers_expired"] += len(dead)
                self._loads.clear()
            return dead

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        with self._lock:
            return self.registry.workers(role)

    def workers_needing_snapshot(self) -> list[WorkerId]:
        """Registered workers the index is stale on or has heard nothing from."""
        with self._lock:
            return [
                info.worker_id
                for info in self.registry.workers()
                if self.index.worker_state(info.worker_id).last_seq < 0
                or self.index.is_stale(info.worker_id)
            ]

    # ---------------------------------------------------------------- rebuild

    def rebuild_from_snapshots(self, snapshots: Mapping[WorkerId, bytes]) -> RebuildResult:
        """Apply each worker's snapshot batch; one bad snapshot fails only its worker."""
        applied: dict[WorkerId, ApplyResult] = {}
        failed: dict[WorkerId, str] = {}
        for wid, data in snapshots.items():
            try:
                batch = decode_batch(data)
                if batch.worker_id != wid or not batch.snapshot:
                    raise EventDecodeError(
                        f"expected a snapshot batch of {wid!r}, got "
                        f"{'a snapshot' if batch.snapshot else 'an event batch'} of "
                        f"{batch.worker_id!r}"
                    )
                with self._lock:
                    info = self.registry.get(wid)
                    if batch.incarnation != info.incarnation:
                        raise InvalidInput(
                            f"snapshot of {wid!r} is from incarnation {batch.incarnation!r}, "
                            f"registered is {info.incarnation!r}"
                        )
                    applied[wid] = self.index.apply(batch)
                    self._counts[f"batches_{applied[wid].value}"] += 1
                    self._loads.clear()
            except KVMeshError as exc:
                failed[wid] = f"{type(exc).__name__}: {exc}"
        return RebuildResult(applied, failed)

    def request_snapshots(self, sources: Mapping[WorkerId, SnapshotSource]) -> RebuildResult:
        """Ask in-process workers for snapshots (`SnapshotSource.snapshot`) and apply them."""
        snaps: dict[WorkerId, bytes] = {}
        failed: dict[WorkerId, str] = {}
        for wid, src in sources.items():
            try:
                snaps[wid] = src.snapshot()
            except Exception as exc:  # a worker's failure must not stop the others
                failed[wid] = f"{type(exc).__name__}: {exc}"
        result = self.rebuild_from_snapshots(snaps)
        result.failed.update(failed)
        return result

    def snapshot_index(self) -> bytes:
        with self._lock:
            return self.index.snapshot()

    def restore_index(self, data: bytes) -> None:
        with self._lock:
            self.index.restore(data)
            for w in self.index.workers():
                if w not in self.registry:
                    self.index.remove_worker(w)
            for info in self.registry.workers():
                self.index.register_worker(info.worker_id, info.incarnation)
            self._loads.clear()

    # ---------------------------------------------------------------- routing

    def _current_loads(self, role: Role | None) -> list[WorkerLoad]:
        loads = self._loads.get(role)
        if loads is None:
            loads = []
            for info in self.registry.workers(role):
                stale = self.index.is_stale(info.worker_id)
                load = info.load
                if load.stale != stale or load.draining != info.draining:
                    load = replace(load, stale=stale, draining=info.draining)
                loads.append(load)
            self._loads[role] = loads
        return loads

    def _policy(self, name: str | None) -> RoutingPolicy:
        key = name or self.config.policy
        policy = self._policies.get(key)
        if policy is None:
            policy = make_policy(key, self.config, self._rng)
            self._policies[key] = policy
        return policy

    def match(self, hashes: Sequence[PageHash]) -> MatchResult:
        with self._lock:
            return self.index.match(hashes)

    def view(self, hashes: Sequence[PageHash], role: Role | None = None) -> RouteView:
        """The index's overlaps for `hashes` and the loads of the workers serving `role`."""
        with self._lock:
            return RouteView(self.index.match(hashes).pages, tuple(self._current_loads(role)))

    def route(
        self,
        hashes: Sequence[PageHash],
        num_tokens: int,
        *,
        page_size: int = 16,
        allow_pull: bool = False,
        role: Role | None = None,
        policy: str | None = None,
        request_id: str = "",
    ) -> RouteDecision:
        """Pick a worker for a request (one index walk + one policy call); raises `NoWorkers`."""
        if policy is not None and policy not in REGISTRY:
            make_policy(policy)  # raises ConfigError naming the known policies
        request = RouteRequest(tuple(hashes), num_tokens, page_size, allow_pull, request_id)
        with self._lock:
            t0 = time.perf_counter_ns()
            matched = self.index.match(request.hashes)
            tiers = self.index.tier_pages(request.hashes, matched)
            decision = self._policy(policy).choose(
                request, matched.pages, self._current_loads(role), tiers
            )
            self._route_ns += time.perf_counter_ns() - t0
            c = self._counts
            c["routes"] += 1
            c["degraded_routes"] += decision.degraded
            c["promised_local_pages"] += decision.local_pages
            c["promised_pull_pages"] += decision.peer_pages if allow_pull else 0
            self._by_worker[decision.worker_id] += 1
            return decision

    def record_result(
        self,
        promised_local: int,
        promised_pull: int,
        realized_local: int,
        realized_pull: int,
    ) -> bool:
        """Count what a worker really hit/pulled against what the decision promised.

        Returns True (and counts a mismatch) when they differ, so a hashing or
        tokenization disagreement between router and worker shows up as a
        number instead of silently zero hits.
        """
        for name, v in (
            ("promised_local", promised_local),
            ("promised_pull", promised_pull),
            ("realized_local", realized_local),
            ("realized_pull", realized_pull),
        ):
            if type(v) is not int or v < 0:
                raise InvalidInput(f"{name} must be a non-negative int, got {v!r}")
        mismatch = (promised_local, promised_pull) != (realized_local, realized_pull)
        with self._lock:
            c = self._counts
            c["results_recorded"] += 1
            c["realized_local_pages"] += realized_local
            c["realized_pull_pages"] += realized_pull
            c["mismatches"] += mismatch
        return mismatch

    def stats(self) -> CoordinatorStats:
        with self._lock:
            c = self._counts
            infos = self.registry.workers()
            routes = c["routes"]
            return CoordinatorStats(
                workers=len(infos),
                stale_workers=len(self.index.stale_workers()),
                draining_workers=sum(1 for i in infos if i.draining),
                indexed_pages=len(self.index),
                index_entries=self.index.num_entries(),
                routes=routes,
                route_time_mean_us=self._route_ns / routes / 1e3 if routes else 0.0,
                degraded_routes=c["degraded_routes"],
                routes_by_worker=dict(self._by_worker),
                batches_applied=c["batches_applied"],
                batches_replaced=c["batches_replaced"],
                batches_ignored=c["batches_ignored"],
                batches_stale=c["batches_stale"],
                batches_rejected=c["batches_rejected"],
                workers_expired=c["workers_expired"],
                promised_local_pages=c["promised_local_pages"],
                promised_pull_pages=c["promised_pull_pages"],
                realized_local_pages=c["realized_local_pages"],
                realized_pull_pages=c["realized_pull_pages"],
                results_recorded=c["results_recorded"],
                mismatches=c["mismatches"],
                links_opened=c["links_opened"],
            )

    def registry_info(self, worker_id: WorkerId) -> WorkerInfo:
        """The worker's registry entry; raises `UnknownWorker`."""
        with self._lock:
            return self.registry.get(worker_id)

    # ---------------------------------------------------------------- dist links

    def open_link(
        self, book: LinkBook, client_id: WorkerId, server_address: str
    ) -> tuple[DistRendezvous, WorkerInfo]:
        """A torch.distributed link for `client_id` to pull from / push to the worker at `server_address`.

        Returns the rendezvous (client rank 0, server rank 1, a fresh store
        prefix) and the server's registry entry (its actor name, for the call
        that asks it to join). Raises `UnknownWorker` when either end is not
        registered, `InvalidInput` for a link to itself.
        """
        with self._lock:
            client = self.registry.get(client_id)
            server = next((i for i in self.registry.workers() if i.address == server_address), None)
        if server is None:
            raise UnknownWorker(
                f"no registered worker serves at {server_address!r}; it left or restarted "
                "under another address (route again)"
            )
        rdv = book.open(
            LinkEnd(client.worker_id, client.incarnation),
            LinkEnd(server.worker_id, server.incarnation),
        )
        with self._lock:
            self._counts["links_opened"] += 1
        return rdv, server
