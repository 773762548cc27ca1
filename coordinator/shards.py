"""The index split across shards, and the router that asks them all.

Pure (no Ray, no gRPC): `kvmesh.coordinator.router` runs each shard as a
Ray actor and this module's `ShardRouter` in front of them;
`ShardedCoordinator` runs the same pieces in one process (tests, benchmarks).

Placement: by worker. A worker (with every page it holds, its registry
entry, its load, its sequence numbers and incarnation) lives in exactly one
shard, ``shard_of(worker_id, n)``: xxh64 of the id, modulo the shard count.
Every router computes the same placement from the id alone, so nothing about
placement has to be stored or agreed. docs/scale.md says why by worker and
not by page hash (measured: a hash-placed shard cannot answer for a worker on
its own, and each route and event batch is split N ways).

Why the merge is exact. A shard is a whole `Coordinator` over its workers:
for a request's hashes it returns each of its workers' longest held prefix
(`GlobalIndex.match`, which depends only on that worker's pages) and its
workers' loads. A worker's prefix in the sharded index is therefore the one
the single index computes, and the union of the shards' answers is the
single index's answer; the loads, merged in worker-id order, are the single
coordinator's list. The policy then gets identical inputs. Stale detection,
snapshots and incarnations are per worker, so they stay inside its shard.

    request hashes ──► shard 0: {w0: 5, w4: 2}, loads(w0, w4)   ─┐
                  ──► shard 1: {w1: 7},        loads(w1, w3)   ─┼─► union + merged loads ─► policy
                  ──► shard 2: {},             loads(w2)       ─┘

Replicas. For two routers to decide the same on the same view, the policy's
random choices (ties, sampling) must not depend on what else a router routed:
with ``per_request_rng`` the generator is reseeded from the request itself
(`request_seed`) before every decision. `round_robin` keeps a turn counter,
which is its own routing history by definition: replicas agree on every
other policy.
"""

from __future__ import annotations

import itertools
import operator
import random
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import xxhash

from kvmesh.config import CoordinatorConfig
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.index import MatchResult
from kvmesh.coordinator.index_store import PromptKeys
from kvmesh.coordinator.policies import (
    Policies,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
)
from kvmesh.coordinator.registry import WorkerInfo
from kvmesh.coordinator.service import (
    Coordinator,
    RebuildResult,
    Registration,
    ReportResult,
    RouteView,
    ViewTable,
    count_decision,
    over_share_pages,
    policy_request,
)
from kvmesh.coordinator.tiers import TierPages
from kvmesh.errors import InvalidInput
from kvmesh.metrics import (
    COORDINATOR_NAMES,
    DEGRADED_ROUTES,
    PREDICTED_PAGES,
    ROUTE_SECONDS,
    ROUTES,
)
from kvmesh.requests import Role
from kvmesh.tenants import TenantWeights
from kvmesh.types import PageHash, WorkerId

ROUTER_COUNTERS = (
    "routes",
    "degraded_routes",
    "promised_local_pages",
    "promised_pull_pages",
)
"""Counters a router keeps itself: the shards see views, never decisions."""


_WORKER_ID = operator.attrgetter("worker_id")
_LOADS = operator.attrgetter("loads")


def shard_of(worker_id: str, num_shards: int) -> int:
    """The shard holding `worker_id`: stable across processes and restarts (xxh64, not `hash`)."""
    if num_shards <= 0:
        raise InvalidInput(f"num_shards must be positive, got {num_shards}")
    return xxhash.xxh64_intdigest(worker_id.encode()) % num_shards


class MergedLoads:
    """The shards' loads merged in worker-id order, kept while no shard's loads change.

    A shard hands out one loads tuple per `Coordinator.loads_version` (and a Ray
    router puts the tuple it holds back into a view that left it out), so route
    after route the same tuples come back: merging them again, a sort of every
    worker's load, was most of what a route at N shards paid beside the N views.
    Keyed by the tuples' identity; the cache holds them, so an id cannot be
    reused while it is a key. Bounded (a few roles' merges). Not thread-safe: its
    owner's lock or event loop guards it.
    """

    def __init__(self, size: int = 8) -> None:
        if size < 1:
            raise InvalidInput(f"size must be at least 1, got {size}")
        self.size = size
        self._merged: dict[
            tuple[int, ...], tuple[tuple[tuple[WorkerLoad, ...], ...], tuple[WorkerLoad, ...]]
        ] = {}

    def of(self, views: Sequence[RouteView]) -> tuple[WorkerLoad, ...]:
        """The loads of `views` (one per shard, disjoint workers) in worker-id order."""
        return self.of_parts(tuple(map(_LOADS, views)))

    def of_parts(self, parts: tuple[tuple[WorkerLoad, ...], ...]) -> tuple[WorkerLoad, ...]:
        """The shards' loads `parts` (disjoint workers) in worker-id order."""
        key = tuple(map(id, parts))
        hit = self._merged.get(key)
        if hit is not None:
            return hit[1]
        # Timsort finds the shards' sorted runs and merges them in C: a Python merge of
        # 64 loads cost more than the shards' index walks.
        merged = tuple(sorted(itertools.chain.from_iterable(parts), key=_WORKER_ID))
        if len(self._merged) >= self.size:
            del self._merged[next(iter(self._merged))]  # the oldest: roles come and go
        self._merged[key] = (parts, merged)
        return merged


def merge_views(views: Iterable[RouteView], loads: MergedLoads | None = None) -> RouteView:
    """One view from the shards' views: overlaps and tiers united, loads merged in worker-id
    order (by `loads`, which keeps the last merges, or afresh).

    Shards hold disjoint workers, so no worker appears twice.
    """
    views = list(views)
    if len(views) == 1:
        return views[0]
    return _merged(views, (loads or MergedLoads(1)).of(views))


def merge_view_batches(
    per_shard: Sequence[Sequence[RouteView]], loads: MergedLoads | None = None
) -> list[RouteView]:
    """`merge_views` of each route of a batch, from each shard's views of the batch in route
    order (`Coordinator.view_many`).

    A shard's views of one role share one loads tuple (object identity survives
    a Ray reply too: pickle keeps shared references), so the loads are merged
    once per batch (or not at all, while `loads` holds their merge), not once
    per route.
    """
    if len(per_shard) == 1:
        return list(per_shard[0])
    merger = loads or MergedLoads()
    return [_merged(views, merger.of(views)) for views in zip(*per_shard, strict=True)]


def merge_view_tables(
    queries: Sequence[RouteQuery], tables: Sequence[ViewTable], loads: MergedLoads | None = None
) -> list[RouteView]:
    """`merge_view_batches` of each shard's `Coordinator.view_table` of `queries`, in query
    order: the shards' prefix tables side by side (their workers are disjoint), and each
    route's overlaps read off the merged table, so a batch costs a Python step per route
    and per worker it names, not per route and shard."""
    merger = loads or MergedLoads()
    if len(tables) == 1:
        lengths = tables[0].prefixes.lengths
        workers = tables[0].prefixes.workers
    else:
        lengths = np.hstack([t.prefixes.lengths for t in tables])
        workers = tuple(itertools.chain.from_iterable(t.prefixes.workers for t in tables))
    merged = {
        role: merger.of_parts(tuple(t.loads[role] for t in tables)) for role in tables[0].loads
    }
    held_rows, held_cols = np.nonzero(lengths)
    names = [workers[j] for j in held_cols.tolist()]
    values = lengths[held_rows, held_cols].tolist()
    counts = np.bincount(held_rows, minlength=len(queries)).tolist()
    whole = set(itertools.chain.from_iterable(t.views for t in tables))
    out: list[RouteView] = []
    at = 0
    for i, (query, n) in enumerate(zip(queries, counts, strict=True)):
        if i in whole:
            out.append(_merged_whole(i, query, tables, merger))
        else:
            overlaps = dict(zip(names[at : at + n], values[at : at + n], strict=True))
            out.append(RouteView(overlaps, merged[query.role], {}, {}, {}))  # type: ignore[arg-type]
        at += n
    return out


def _merged_whole(
    i: int, query: RouteQuery, tables: Sequence[ViewTable], merger: MergedLoads
) -> RouteView:
    """Route `i`'s merged view from the shards' tables, where some shard sent its whole view."""
    views = []
    for t in tables:
        view = t.views.get(i)
        if view is None:
            pages, tiers = t.prefixes.overlaps(i)
            view = RouteView(pages, t.loads[query.role], tiers, {}, {}, t.loads_version)
        views.append(view)
    return views[0] if len(views) == 1 else _merged(views, merger.of(views))


def _merged(views: Sequence[RouteView], loads: tuple[WorkerLoad, ...]) -> RouteView:
    overlaps: dict[WorkerId, int] = {}
    tiers: dict[WorkerId, TierPages] = {}
    tenant_totals: dict[str, int] = {}
    tenant_pages: dict[WorkerId, int] = {}
    for v in views:
        overlaps.update(v.overlaps)
        if v.tiers:  # the rest are empty on most routes: a test costs less than an update
            tiers.update(v.tiers)
        if v.tenant_pages:
            tenant_pages.update(v.tenant_pages)
        for tenant, n in v.tenant_totals.items():
            tenant_totals[tenant] = tenant_totals.get(tenant, 0) + n
    return RouteView(overlaps, loads, tiers, tenant_totals, tenant_pages)


def merge_matches(results: Sequence[MatchResult]) -> MatchResult:
    """The single index's `MatchResult` from the shards' (disjoint workers)."""
    pages: dict[WorkerId, int] = {}
    tiers: dict[WorkerId, tuple[str, ...]] = {}
    for r in results:
        pages.update(r.pages)
        tiers.update(r.tiers)
    device_only = bool(results) and all(r.device_only for r in results)
    return MatchResult(pages, tiers, results[0].num_hashes if results else 0, device_only)


def request_seed(seed: int, request: RouteRequest) -> int:
    """A seed from the request alone, so that every replica draws the same random choices."""
    h = xxhash.xxh64(struct.pack("<qqq", seed, request.num_tokens, request.page_size))
    h.update(request.request_id.encode())
    for page_hash in request.hashes:
        h.update(page_hash)
    return h.intdigest()


def merge_stats(
    shard_stats: Sequence[Mapping[str, Any]], router: Mapping[str, Any]
) -> dict[str, Any]:
    """The cluster's counters: the shards' summed, routing counters from the router.

    `indexed_pages` sums the shards', so a page held by workers of two shards
    counts twice (it is stored twice).
    """
    out: dict[str, Any] = {}
    for stats in shard_stats:
        for key, value in stats.items():
            if key in ROUTER_COUNTERS or key in ("routes_by_worker", "route_time_mean_us"):
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
    out.update(router)
    return out


class SlowShards:
    """A router's own shards that answered late or failed lately, so routes stop waiting on them.

    A route asks its own replica's shard first and the other replicas only
    after a hedge delay. While a shard restarts (it rebuilds before it
    answers) every route would wait that delay again; a shard marked slow is
    asked in every replica at once instead, first answer wins, until
    `hold_s` passes without a new mark or it answers first again. Pure: the
    clock is passed in. Not thread-safe (one router's event loop uses it).
    """

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if hold_s < 0:
            raise InvalidInput(f"hold_s must be >= 0, got {hold_s}")
        self.hold_s = hold_s
        self.clock = clock
        self._until: dict[int, float] = {}

    def mark(self, shard: int) -> None:
        """`shard` was late or failed: ask every replica at once for the next `hold_s`."""
        self._until[shard] = self.clock() + self.hold_s

    def clear(self, shard: int) -> None:
        """`shard` answered first again: back to asking it alone."""
        self._until.pop(shard, None)

    def is_slow(self, shard: int) -> bool:
        until = self._until.get(shard)
        if until is None:
            return False
        if until <= self.clock():
            del self._until[shard]
            return False
        return True


class ShardRouter:
    """The policy step of a sharded coordinator: a merged view in, a decision out.

    Thread-safe only behind its owner's lock (policies keep state). `rng` is
    shared by the policies, as in `Coordinator`; with `per_request_rng` it is
    reseeded per request (replicas).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        rng: random.Random | None = None,
        *,
        per_request_rng: bool = False,
        name: str | None = None,
    ) -> None:
        self.config = config
        self.per_request_rng = per_request_rng
        self._rng = rng if rng is not None else random.Random(config.seed)
        self._policies = Policies(config, self._rng)
        self.tenant_weights = TenantWeights.parse(config.tenant_weights)
        # its decisions count in kvmesh.metrics under its own name, as a Coordinator's do
        self.name = COORDINATOR_NAMES.claim(self, name or f"{config.actor_name}-router")

    def policy(self, name: str | None) -> RoutingPolicy:
        """The policy named `name` (None: the config's); raises `ConfigError` for unknown names."""
        return self._policies.get(name)

    def decide(self, query: RouteQuery, view: RouteView) -> RouteDecision:
        """The policy's decision on `view` (the shards' merged views for `query`, tenant
        counts included when it names a tenant); raises `NoWorkers` when it has no load."""
        policy = query.policy
        chosen = self.policy(policy)  # an unknown name raises before anything is counted
        t0 = time.perf_counter_ns()
        crowded = None
        if query.tenant is not None and self.config.tenant_share_weight > 0:
            crowded = over_share_pages(
                self.tenant_weights, view.tenant_totals, query.tenant, view.tenant_pages
            )
        request = policy_request(query, crowded)
        if self.per_request_rng:
            self._rng.seed(request_seed(self.config.seed, request))
        decision = chosen.choose(request, view.overlaps, view.loads, view.tiers)
        elapsed_s = (time.perf_counter_ns() - t0) / 1e9
        count_decision(self.name, policy or self.config.policy, decision, query, elapsed_s)
        return decision

    def stats(self) -> dict[str, Any]:
        """`ROUTER_COUNTERS`, the mean decision time and routes per worker, read from its
        metrics."""
        me = {"coordinator": self.name}
        routes = int(ROUTES.value(**me))
        route_s = ROUTE_SECONDS.histogram_sum(**me)
        return {
            "routes": routes,
            "degraded_routes": int(DEGRADED_ROUTES.value(**me)),
            "promised_local_pages": int(PREDICTED_PAGES.value(**me, kind="local")),
            "promised_pull_pages": int(PREDICTED_PAGES.value(**me, kind="pull")),
            "route_time_mean_us": route_s / routes * 1e6 if routes else 0.0,
            "routes_by_worker": {w: int(n) for w, n in ROUTES.values_by("worker", **me).items()},
        }


class ShardedCoordinator:
    """`config.index_shards` `Coordinator` cores and a `ShardRouter`, in one process.

    The same API as `Coordinator` for what workers and clients call; what it
    decides is what the single `Coordinator` decides on the same calls (the
    property test in tests/coordinator/test_shards.py replays the bundled
    trace through both).
    """

    def __init__(
        self,
        config: CoordinatorConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        per_request_rng: bool = False,
    ) -> None:
        self.config = config or CoordinatorConfig()
        self.shards = [
            Coordinator(self.config, clock=clock) for _ in range(self.config.index_shards)
        ]
        self.router = ShardRouter(self.config, rng, per_request_rng=per_request_rng)
        self._loads = MergedLoads()

    def shard(self, worker_id: WorkerId) -> Coordinator:
        """The shard holding `worker_id` (`shard_of`)."""
        return self.shards[shard_of(worker_id, len(self.shards))]

    def register_worker(self, reg: WorkerRegistration) -> Registration:
        return self.shard(reg.check().worker_id).register_worker(reg)

    def report(self, report: WorkerReport) -> ReportResult:
        """The worker's shard applies its batches and counts its requests' outcomes."""
        return self.shard(report.check().worker_id).report(report)

    def heartbeat(self, worker_id: WorkerId, load: WorkerLoad | None = None) -> ReportResult:
        return self.shard(worker_id).heartbeat(worker_id, load)

    def drain_worker(self, worker_id: WorkerId, draining: bool = True) -> None:
        self.shard(worker_id).drain_worker(worker_id, draining)

    def remove_worker(self, worker_id: WorkerId) -> bool:
        return self.shard(worker_id).remove_worker(worker_id)

    def expire(self, now: float | None = None) -> list[WorkerId]:
        return sorted(w for s in self.shards for w in s.expire(now))

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        return sorted((i for s in self.shards for i in s.workers(role)), key=lambda i: i.worker_id)

    def rebuild_from_snapshots(self, snapshots: Mapping[WorkerId, bytes]) -> RebuildResult:
        """Each snapshot to its worker's shard; one bad snapshot fails only its worker."""
        applied: dict[WorkerId, Any] = {}
        failed: dict[WorkerId, str] = {}
        for i, shard in enumerate(self.shards):
            mine = {w: d for w, d in snapshots.items() if shard_of(w, len(self.shards)) == i}
            if mine:
                r = shard.rebuild_from_snapshots(mine)
                applied.update(r.applied)
                failed.update(r.failed)
        return RebuildResult(applied, failed)

    def match(self, hashes: Sequence[PageHash]) -> MatchResult:
        return merge_matches([s.match(hashes) for s in self.shards])

    def view(self, query: RouteQuery) -> RouteView:
        if len(self.shards) == 1:
            return self.shards[0].view(query)
        keys = PromptKeys.of((query.hashes,))  # what every shard's lookup needs, made once
        if query.tenant is not None and self.config.tenant_share_weight > 0:
            return merge_views([s.view(query, None, keys) for s in self.shards], self._loads)
        # each shard adds its overlaps to one dict and returns its loads: no view, no dict per shard
        overlaps: dict[WorkerId, int] = {}
        tiers: dict[WorkerId, TierPages] = {}
        parts = tuple([shard.overlaps_into(query, keys, overlaps, tiers) for shard in self.shards])
        return RouteView(overlaps, self._loads.of_parts(parts), tiers, {}, {})

    def view_many(self, queries: Sequence[RouteQuery]) -> list[RouteView]:
        """`view` of each query, with one call per shard for them all, each a round of numpy
        calls over the whole batch (`Coordinator.view_table`, `merge_view_tables`)."""
        if not queries:
            return []
        keys = PromptKeys.of([query.hashes for query in queries])
        return merge_view_tables(
            queries, [s.view_table(queries, keys) for s in self.shards], self._loads
        )

    def route(self, query: RouteQuery) -> RouteDecision:
        """Fan out to every shard, merge, decide (see the module docstring); raises `NoWorkers`."""
        if query.split:
            prefill, decode = query.halves()
            return replace(self.route(prefill), decode=self.route(decode))
        return self._decide(query, self.view(query))

    def route_many(self, queries: Sequence[RouteQuery]) -> list[RouteDecision]:
        """`route` of each query, in order, asking each shard once for all of them: what a
        router does with the routes that arrive together (each shard's per-call cost and its
        lookup's fixed cost are paid once per batch, not once per route).

        Every view is taken before the first decision, as for routes that arrive
        at once: a request on its way counts in its worker's load for the routes
        after the batch, not for those beside it (they did not see it on a
        single coordinator either, had they raced it). A bad query raises
        `InvalidInput` before any route is decided; `NoWorkers` is raised at its
        route's turn, the routes before it decided.
        """
        if any(query.split for query in queries):  # two routes each: one at a time
            return [self.route(query) for query in queries]
        for query in queries:
            query.check()
        views = self.view_many(queries)
        return [self._decide(q, v) for q, v in zip(queries, views, strict=True)]

    def _decide(self, query: RouteQuery, view: RouteView) -> RouteDecision:
        decision = self.router.decide(query, view)
        if query.request_id:  # a request on its way, counted in its load (`Coordinator.route`)
            self.shard(decision.worker_id).count_routed(decision, policy_request(query))
        return decision

    def stats(self) -> dict[str, Any]:
        return merge_stats([s.stats().as_dict() for s in self.shards], self.router.stats())
