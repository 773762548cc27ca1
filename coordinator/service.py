"""The coordinator as a plain thread-safe class: index + registry + policy + stats.

No Ray here: `kvmesh.coordinator.actor` wraps this class in a Ray actor, and
tests, the simulator and a gRPC front end can use it directly. One lock
guards everything; every public method takes it once.

What the coordinator needs from a worker
----------------------------------------
Only two things, both in `kvmesh` types:

- it calls `register_worker(WorkerRegistration(...))` once per incarnation,
  then `report(WorkerReport(worker_id, batches, load))` every heartbeat
  interval with its encoded event batches (`kvmesh.events.encode_batch`,
  sequence numbers from 0 per incarnation);
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

import operator
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from kvmesh.config import CoordinatorConfig
from kvmesh.coordination import ReportMark, RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.index import GlobalIndex, MatchResult, PrefixTable
from kvmesh.coordinator.index_store import PromptKeys
from kvmesh.coordinator.policies import (
    Policies,
    RouteDecision,
    RouteRequest,
    WorkerLoad,
)
from kvmesh.coordinator.registry import WorkerInfo, WorkerRegistry
from kvmesh.coordinator.tenant_shares import TenantShare, TenantShares
from kvmesh.coordinator.tiers import TierPages
from kvmesh.errors import EventDecodeError, InvalidInput, KVMeshError, UnknownWorker
from kvmesh.events import ApplyResult, EventBatch, decode_batch
from kvmesh.metrics import (
    COORDINATOR_ERRORS,
    COORDINATOR_NAMES,
    DEGRADED_ROUTES,
    EVENT_BATCHES,
    EVENT_GAPS,
    EVENT_LAG,
    INDEXED_PAGES,
    LINKS_OPENED,
    PREDICTED_PAGES,
    REALIZED_PAGES,
    ROUTE_RESULTS,
    ROUTE_SECONDS,
    ROUTES,
    WORKERS,
    WORKERS_EXPIRED,
    Metric,
)
from kvmesh.rendezvous import DistRendezvous, LinkBook, LinkEnd
from kvmesh.requests import Role
from kvmesh.tenants import TenantWeights
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
    """State and counters since start, read from the coordinator's metrics (`as_dict` for
    JSON)."""

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
    tiers: dict[WorkerId, TierPages] = field(default_factory=dict)
    """`GlobalIndex.tier_pages` of the overlaps: workers holding part of theirs off the device."""
    tenant_totals: dict[str, int] = field(default_factory=dict)
    """With a query's tenant: every tenant's pages on these workers (all tiers), for its share."""
    tenant_pages: dict[WorkerId, int] = field(default_factory=dict)
    """With a query's tenant: the pages that tenant holds on each of these workers."""
    loads_version: int = field(default=0, compare=False)
    """The answering coordinator's `Coordinator.loads_version` of `loads`: a router that holds
    the loads of that version reuses them (and a shard may then leave `loads` empty)."""


@dataclass(frozen=True, slots=True)
class ViewTable:
    """`Coordinator.view_many` as a router in the same process merges it
    (`kvmesh.coordinator.shards.merge_view_tables`): the batch's `PrefixTable`, the loads
    of each role its queries name, and the whole `RouteView` of the queries a table row
    does not say enough about (a tenant's counts, or pages held off the device), so the
    shard pays no Python step per route for the others."""

    prefixes: PrefixTable
    loads: dict[Role | None, tuple[WorkerLoad, ...]]
    views: dict[int, RouteView]
    loads_version: int


def policy_request(
    query: RouteQuery, tenant_pages: Mapping[WorkerId, int] | None = None
) -> RouteRequest:
    """What a policy reads of `query` (plus the tenant's pages when it is over its share)."""
    return RouteRequest(
        query.hashes,
        query.num_tokens,
        query.page_size,
        query.allow_pull,
        query.request_id,
        tenant_pages,
    )


def count_decision(
    name: str, policy: str, decision: RouteDecision, query: RouteQuery, elapsed_s: float
) -> None:
    """A decision in the metrics of coordinator `name` (a `Coordinator` or the router in
    front of shards): its time, its worker, whether degraded, the pages it promised."""
    ROUTE_SECONDS.labels(name, policy).observe(elapsed_s)
    ROUTES.labels(name, policy, decision.worker_id).inc()
    if decision.degraded:
        DEGRADED_ROUTES.labels(name).inc()
    PREDICTED_PAGES.labels(name, "local").inc(decision.local_pages)
    if query.allow_pull:
        PREDICTED_PAGES.labels(name, "pull").inc(decision.peer_pages)


def over_share_pages(
    weights: TenantWeights,
    tenant_totals: Mapping[str, int],
    tenant: str,
    tenant_pages: Mapping[WorkerId, int],
) -> dict[WorkerId, int] | None:
    """`tenant_pages` when `tenant` holds more than its fair share of all tenants' pages
    (`tenant_totals`, the whole cluster's), else None: `RouteRequest.tenant_pages`.

    One definition for the single coordinator and a router merging shards' views, over
    tenants in name order, so both compute the same floats and decide alike."""
    counts = {t: tenant_totals[t] for t in sorted(tenant_totals) if tenant_totals[t] > 0}
    held = counts.get(tenant, 0)
    if not held or not held > weights.shares(counts, sum(counts.values()))[tenant]:
        return None
    return {w: n for w, n in sorted(tenant_pages.items()) if n}


_ROLE = operator.attrgetter("role")


def _random_version() -> int:
    """A starting `Coordinator.loads_version` no other coordinator shares (63 random bits)."""
    return random.SystemRandom().getrandbits(63)


class Coordinator:
    """Thread-safe coordinator core; see the module docstring for the worker side.

    `clock` (monotonic seconds) drives heartbeat expiry; `rng` drives every
    random choice of the policies, so a seeded run is repeatable. `name`
    labels its metrics (``coordinator``; default the actor name); a second
    live coordinator of one name in a process counts as ``name#2``.
    """

    def __init__(
        self,
        config: CoordinatorConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        name: str | None = None,
    ) -> None:
        self.config = config or CoordinatorConfig()
        self.name = COORDINATOR_NAMES.claim(self, name or self.config.actor_name)
        self.clock = clock
        self._rng = rng if rng is not None else random.Random(self.config.seed)
        self._lock = threading.RLock()
        self.index = GlobalIndex(
            require_registration=True,
            default_tier=self.config.default_tier,
            reorder_window=self.config.reorder_window,
        )
        self.tenant_shares = TenantShares(
            TenantWeights.parse(self.config.tenant_weights), default_tier=self.config.default_tier
        )
        self.index.add_observer(self.tenant_shares)
        self.registry = WorkerRegistry(clock)
        self._policies = Policies(self.config, self._rng)
        self._policies.get(None)  # an unknown policy in the config fails here, not at a route
        self._loads: dict[Role | None, tuple[WorkerLoad, ...]] = {}
        # Each change of the loads takes a new version, random-based so that two
        # coordinators (a shard and its restart, two replicas) never share one: a
        # router holding a shard's loads of that version need not be sent them again.
        self.loads_version = _random_version()
        self._workers_gauges = {
            s: WORKERS.labels(self.name, s) for s in ("all", "stale", "draining")
        }
        self._indexed_pages = INDEXED_PAGES.labels(self.name)

    # ---------------------------------------------------------------- workers

    def register_worker(self, reg: WorkerRegistration) -> Registration:
        """Add (or refresh) a worker. A new incarnation drops the old one's index entries."""
        worker_id, incarnation = reg.worker_id, reg.incarnation
        with self._lock:
            self.registry.register(reg)
            self.index.register_worker(worker_id, incarnation)
            self._forget_loads()
            self._export_gauges()
            state = self.index.worker_state(worker_id)
            return Registration(
                worker_id,
                incarnation,
                state.last_seq < 0 or state.stale,
                self.config.heartbeat_interval_s,
                self.config.heartbeat_timeout_s,
            )

    def report(self, report: WorkerReport) -> ReportResult:
        """Heartbeat plus event batches, applied in order, plus the outcomes of the
        worker's requests since its last report (`record_result` for each).

        Every batch is decoded and checked (it must come from the reporting worker), and
        every outcome, before any is applied, so a bad one rejects the whole
        report (`EventDecodeError`, `InvalidInput`) and changes nothing. Batches
        of another incarnation than the registered one are ignored. Raises
        `UnknownWorker` when the worker must register again.
        """
        worker_id, encoded_batches = report.check().worker_id, report.batches
        checked = [o.check() for o in report.outcomes]
        decoded: list[EventBatch] = []
        try:
            for data in encoded_batches:
                batch = decode_batch(data)
                if batch.worker_id != worker_id:
                    raise EventDecodeError(
                        f"worker {worker_id!r} reported a batch of {batch.worker_id!r}"
                    )
                decoded.append(batch)
        except EventDecodeError as exc:
            with self._lock:
                # an unregistered id is not a label: anyone reaching the API could mint them
                who = worker_id if worker_id in self.registry else "unregistered"
            EVENT_BATCHES.labels(self.name, who, "rejected").inc(len(encoded_batches))
            COORDINATOR_ERRORS.labels(self.name, type(exc).__name__).inc()
            raise
        with self._lock:
            info = self.registry.heartbeat(worker_id, report.load)
            results: list[ApplyResult] = []
            now = time.time()
            # batches of another incarnation are ignored; the others go in as one call
            applied = iter(
                self.index.apply_many([b for b in decoded if b.incarnation == info.incarnation])
            )
            for batch in decoded:
                if batch.incarnation != info.incarnation:
                    results.append(ApplyResult.IGNORED)
                else:
                    results.append(next(applied))
                    if batch.ts > 0:  # stamped by its sender (wall clock)
                        EVENT_LAG.labels(self.name, worker_id).observe(max(0.0, now - batch.ts))
                self._count_batch(worker_id, results[-1])
            self._forget_loads()
            self._export_gauges()
            reply = ReportResult(tuple(results), self.index.is_stale(worker_id))
        for o in checked:
            self.record_result(o.promised_local, o.promised_pull, o.realized_local, o.realized_pull)
        return reply

    def _count_batch(self, worker_id: WorkerId, result: ApplyResult) -> None:
        EVENT_BATCHES.labels(self.name, worker_id, result.value).inc()
        if result is ApplyResult.STALE:
            EVENT_GAPS.labels(self.name, worker_id).inc()

    def _export_gauges(self) -> None:
        """Refresh the worker and index gauges (under the lock, after a change)."""
        infos = self.registry.workers()
        self._workers_gauges["all"].set(len(infos))
        self._workers_gauges["stale"].set(len(self.index.stale_workers()))
        self._workers_gauges["draining"].set(sum(1 for i in infos if i.draining))
        self._indexed_pages.set(len(self.index))

    def heartbeat(self, worker_id: WorkerId, load: WorkerLoad | None = None) -> ReportResult:
        """A report without events."""
        return self.report(WorkerReport(worker_id, (), load))

    def drain_worker(self, worker_id: WorkerId, draining: bool = True) -> None:
        with self._lock:
            self.registry.drain(worker_id, draining)
            self._forget_loads()
            self._export_gauges()

    def remove_worker(self, worker_id: WorkerId) -> bool:
        """Forget a worker and drop its index entries; False if it was not known."""
        with self._lock:
            known = self.registry.remove(worker_id) is not None
            dropped = worker_id in self.index.workers()
            self.index.remove_worker(worker_id)
            self._forget_loads()
            self._export_gauges()
            return known or dropped

    def expire(self, now: float | None = None) -> list[WorkerId]:
        """Remove the workers that missed heartbeats for `heartbeat_timeout_s`."""
        with self._lock:
            dead = self.registry.expire(now, self.config.heartbeat_timeout_s)
            for w in dead:
                self.index.remove_worker(w)
            if dead:
                WORKERS_EXPIRED.labels(self.name).inc(len(dead))
                self._forget_loads()
                self._export_gauges()
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
                    applied[wid] = self.index.apply_decoded(batch)
                    self._count_batch(wid, applied[wid])
                    self._forget_loads()
                    self._export_gauges()
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
            self._forget_loads()
            self._export_gauges()

    # ---------------------------------------------------------------- routing

    def _forget_loads(self) -> None:
        """The loads changed (a report, a worker in or out): build them again when asked."""
        self._loads.clear()
        self.loads_version += 1

    def _current_loads(self, role: Role | None) -> tuple[WorkerLoad, ...]:
        """The loads of `role`'s workers in worker-id order; one tuple per `loads_version`, so
        a router can tell by identity that nothing changed."""
        loads = self._loads.get(role)
        if loads is None:
            built = []
            for info in self.registry.workers(role):
                stale = self.index.is_stale(info.worker_id)
                load = info.load
                if load.stale != stale or load.draining != info.draining:
                    load = replace(load, stale=stale, draining=info.draining)
                built.append(load)
            loads = self._loads[role] = tuple(built)
        return loads

    def tenant_share_view(self) -> dict[str, TenantShare]:
        """Each tenant's pages across the cluster against its fair share (from the events)."""
        with self._lock:
            return self.tenant_shares.shares()

    def match(self, hashes: Sequence[PageHash]) -> MatchResult:
        with self._lock:
            return self.index.match(hashes)

    def view(
        self,
        query: RouteQuery,
        known_loads_version: int | None = None,
        keys: PromptKeys | None = None,
    ) -> RouteView:
        """The index's overlaps (and their tiers) for the query's hashes, the loads of the
        workers serving its role and, with a tenant, the tenant counts a router needs to
        weigh its fair share (`over_share_pages`).

        With `known_loads_version` equal to `loads_version`, the caller already holds
        these loads: they are left out (an empty `loads`), so a shard does not send them
        over again on every route. `keys`: `PromptKeys.of([query.hashes])`, made once by
        a router asking several shards in one process.
        """
        with self._lock:
            return self._view(query, self.index.overlaps(query.hashes, keys), known_loads_version)

    def overlaps_into(
        self,
        query: RouteQuery,
        keys: PromptKeys,
        pages: dict[WorkerId, int],
        tiers: dict[WorkerId, TierPages],
    ) -> tuple[WorkerLoad, ...]:
        """`view` without the view, for a router in the same process merging shards (and no
        tenant): the overlaps and their tiers added to the router's `pages` and `tiers`
        (`GlobalIndex.overlaps_into`), and the role's loads returned, with no `RouteView`
        nor dict of overlaps built per shard."""
        with self._lock:
            self.index.overlaps_into(query.hashes, keys, pages, tiers)
            return self._current_loads(query.role)

    def view_many(
        self,
        queries: Sequence[RouteQuery],
        known_loads_version: int | None = None,
        keys: PromptKeys | None = None,
    ) -> list[RouteView]:
        """`view` of each query, their pages looked up together (`GlobalIndex.match_many`):
        a router's concurrent routes cost a shard one call and one lookup. The views of one
        role share one loads tuple, so a router merges it once per batch. `keys`:
        `PromptKeys.of` the queries' hashes."""
        with self._lock:
            matched = self.index.overlaps_many([query.hashes for query in queries], keys)
            return [
                self._view(query, match, known_loads_version)
                for query, match in zip(queries, matched, strict=True)
            ]

    def view_table(
        self, queries: Sequence[RouteQuery], keys: PromptKeys | None = None
    ) -> ViewTable:
        """`view_many` as a `ViewTable`: every query's overlaps found in one round of numpy
        calls (`GlobalIndex.prefix_table`), so a batch of routes costs a shard the same few
        calls whatever its size. `keys`: `PromptKeys.of` the queries' hashes."""
        with self._lock:
            table = self.index.prefix_table([query.hashes for query in queries], keys)
            loads = {role: self._current_loads(role) for role in set(map(_ROLE, queries))}
            whole: dict[int, RouteView] = {}
            tenants = self.config.tenant_share_weight > 0
            if table.tiered or tenants:
                for i, query in enumerate(queries):
                    if i in table.tiered or (tenants and query.tenant is not None):
                        whole[i] = self._view(query, table.overlaps(i), None)
            return ViewTable(table, loads, whole, self.loads_version)

    def _view(
        self,
        query: RouteQuery,
        overlaps: tuple[dict[WorkerId, int], dict[WorkerId, TierPages]],
        known_loads_version: int | None,
    ) -> RouteView:
        """One query's view from its `GlobalIndex.overlaps` (under the lock)."""
        version = self.loads_version
        loads = () if known_loads_version == version else self._current_loads(query.role)
        pages, tiers = overlaps
        if query.tenant is not None and self.config.tenant_share_weight > 0:
            totals, tenant_pages = self._tenant_counts(query.tenant)
            return RouteView(pages, loads, tiers, totals, tenant_pages, version)
        return RouteView(pages, loads, tiers, {}, {}, version)

    def _tenant_counts(self, tenant: str) -> tuple[dict[str, int], dict[WorkerId, int]]:
        """Every tenant's pages here, and `tenant`'s per worker (under the lock; O(workers))."""
        shares = self.tenant_shares
        totals = {t: s.pages for t, s in shares.shares().items()}
        pages = {
            info.worker_id: n
            for info in self.registry.workers()
            if (n := shares.worker_pages(info.worker_id, tenant))
        }
        return totals, pages

    def reported(self, marks: Sequence[ReportMark]) -> bool:
        """Whether every mark's batch is applied (or can no longer be: its worker is gone or
        restarted), so a route that waits for them may go on."""
        with self._lock:
            for mark in marks:
                if mark.worker_id not in self.registry:
                    continue
                state = self.index.worker_state(mark.worker_id)
                if state.incarnation == mark.incarnation and state.last_seq < mark.seq:
                    return False
            return True

    def route(self, query: RouteQuery) -> RouteDecision:
        """Pick a worker for a request (one index walk + one policy call); raises `NoWorkers`.

        With `query.tenant` holding more than its fair share of the cluster's pages,
        `kv_aware` weighs the pages it would take from other tenants on each worker
        (`over_share_pages`). `query.after` is the async shells' (`CoordinatorActor`):
        here every report is applied before it returns."""
        if query.split:
            prefill, decode = query.halves()
            return replace(self.route(prefill), decode=self.route(decode))
        Policies.check(query.policy)
        with self._lock:
            t0 = time.perf_counter_ns()
            crowded = None
            if query.tenant is not None and self.config.tenant_share_weight > 0:
                totals, pages = self._tenant_counts(query.tenant)
                crowded = over_share_pages(self.tenant_shares.weights, totals, query.tenant, pages)
            request = policy_request(query, crowded)
            matched = self.index.match(request.hashes)
            tiers = self.index.tier_pages(request.hashes, matched)
            decision = self._policies.get(query.policy).choose(
                request, matched.pages, self._current_loads(query.role), tiers
            )
            elapsed_s = (time.perf_counter_ns() - t0) / 1e9
            if query.request_id:  # a request on its way (not a look), counted in its load
                self._count_routed(decision, request)
        count_decision(self.name, query.policy or self.config.policy, decision, query, elapsed_s)
        return decision

    def count_routed(self, decision: RouteDecision, request: RouteRequest) -> None:
        """What `route` does for a request on its way, for one a sharded router decided:
        the chosen worker's shard counts it in that worker's load."""
        with self._lock:
            self._count_routed(decision, request)

    def _count_routed(self, decision: RouteDecision, request: RouteRequest) -> None:
        """The chosen worker's load, here and in the cached loads, plus this request's
        prefill (O(workers)); its next report replaces it with what it measured."""
        reused = decision.local_pages + (decision.peer_pages if request.allow_pull else 0)
        prefill = request.num_tokens - reused * request.page_size
        load = self.registry.routed(decision.worker_id, prefill)
        if load is None:
            return
        for role, loads in self._loads.items():
            for i, cached in enumerate(loads):
                if cached.worker_id == decision.worker_id:
                    routed = replace(
                        cached,
                        active_prefill_tokens=load.active_prefill_tokens,
                        active_requests=load.active_requests,
                    )
                    self._loads[role] = (*loads[:i], routed, *loads[i + 1 :])
                    break
        self.loads_version += 1

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
        REALIZED_PAGES.labels(self.name, "local").inc(realized_local)
        REALIZED_PAGES.labels(self.name, "pull").inc(realized_pull)
        ROUTE_RESULTS.labels(self.name, "mismatch" if mismatch else "kept").inc()
        return mismatch

    def stats(self) -> CoordinatorStats:
        """The coordinator's state now and its counters, read from its metrics."""
        me = {"coordinator": self.name}

        def count(metric: Metric, **labels: str) -> int:
            return int(metric.value(**me, **labels))

        with self._lock:
            infos = self.registry.workers()
            workers = len(infos)
            stale = len(self.index.stale_workers())
            draining = sum(1 for i in infos if i.draining)
            indexed, entries = len(self.index), self.index.num_entries()
        routes = count(ROUTES)
        route_s = ROUTE_SECONDS.histogram_sum(**me)
        return CoordinatorStats(
            workers=workers,
            stale_workers=stale,
            draining_workers=draining,
            indexed_pages=indexed,
            index_entries=entries,
            routes=routes,
            route_time_mean_us=route_s / routes * 1e6 if routes else 0.0,
            degraded_routes=count(DEGRADED_ROUTES),
            routes_by_worker={w: int(v) for w, v in ROUTES.values_by("worker", **me).items()},
            batches_applied=count(EVENT_BATCHES, outcome="applied"),
            batches_replaced=count(EVENT_BATCHES, outcome="replaced"),
            batches_ignored=count(EVENT_BATCHES, outcome="ignored"),
            batches_stale=count(EVENT_BATCHES, outcome="stale"),
            batches_rejected=count(EVENT_BATCHES, outcome="rejected"),
            workers_expired=count(WORKERS_EXPIRED),
            promised_local_pages=count(PREDICTED_PAGES, kind="local"),
            promised_pull_pages=count(PREDICTED_PAGES, kind="pull"),
            realized_local_pages=count(REALIZED_PAGES, kind="local"),
            realized_pull_pages=count(REALIZED_PAGES, kind="pull"),
            results_recorded=count(ROUTE_RESULTS),
            mismatches=count(ROUTE_RESULTS, outcome="mismatch"),
            links_opened=count(LINKS_OPENED),
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
        LINKS_OPENED.labels(self.name).inc()
        return rdv, server
