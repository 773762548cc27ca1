"""The cluster's pages per tenant and tier, counted from the events the index applies.

Pure (no Ray, no gRPC). `TenantShares` is an `IndexObserver`: it sees every
batch the index applies (in sequence order, held-back batches when their gap
fills, duplicates never) and every time the index drops a worker (snapshot,
new incarnation, removal), so its counts follow the index exactly:

- ``PagesStored(tenant=t, medium=m)`` adds its pages to (worker, tier m, t);
- ``PagesRemoved(tenant=t, medium=m)`` takes them away (never below 0: the
  index ignores removals of pages it never had, so do the counts); a removal
  with medium None counts against the index's default tier;
- ``AllPagesCleared`` and a dropped worker forget the worker's counts.

A worker's pool emits one stored event when a hash gains its first page and
one removed event when it loses its last, so the counts are distinct pages
per worker and tier. Memory: one int per (worker, tier, tenant), none per page.

A tenant's fair share is the cluster's cached pages (all tiers) split by
weight among the tenants holding any (`kvmesh.tenants.TenantWeights`); the
counts and shares are published as `kvmesh_tenant_cluster_pages` and
`kvmesh_tenant_share_pages`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.coordinator.index import TIER_NAMES, tier_of
from kvmesh.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from kvmesh.metrics import TENANT_CLUSTER_PAGES, TENANT_SHARE_PAGES
from kvmesh.tenants import DEFAULT_TENANT, TenantWeights
from kvmesh.types import WorkerId

_Key = tuple[int, str]
"""(tier bit, tenant)."""


@dataclass(frozen=True, slots=True)
class TenantShare:
    """One tenant's pages across the cluster against its fair share of them."""

    tenant: str
    pages: int
    share: float
    pages_by_tier: Mapping[str, int]

    @property
    def over_share(self) -> bool:
        return self.pages > self.share


class TenantShares:
    """Per-tenant page counts of the whole cluster; see the module docstring.

    Not thread-safe: the coordinator applies events under its lock, and reads
    shares under it too.
    """

    def __init__(self, weights: TenantWeights | None = None, *, default_tier: str = "gpu") -> None:
        self.weights = weights or TenantWeights()
        self._default_bit = TIER_NAMES.index(default_tier)
        self._by_worker: dict[WorkerId, Counter[_Key]] = {}
        self._totals: Counter[_Key] = Counter()

    # ------------------------------------------------------------------ IndexObserver

    def events_applied(self, worker_id: WorkerId, events: Sequence[KVEvent]) -> None:
        counts = self._by_worker.get(worker_id)
        if counts is None:
            counts = self._by_worker[worker_id] = Counter()
        touched: set[_Key] = set()
        for ev in events:
            if isinstance(ev, PagesStored):
                key = (tier_of(ev.medium, self._default_bit), ev.tenant or DEFAULT_TENANT)
                counts[key] += len(ev.page_hashes)
                self._totals[key] += len(ev.page_hashes)
                touched.add(key)
            elif isinstance(ev, PagesRemoved):
                key = (tier_of(ev.medium, self._default_bit), ev.tenant or DEFAULT_TENANT)
                gone = min(len(ev.page_hashes), counts[key])
                counts[key] -= gone
                self._totals[key] -= gone
                touched.add(key)
            elif isinstance(ev, AllPagesCleared):
                touched.update(self._forget(worker_id))
                counts = self._by_worker[worker_id] = Counter()
        self._publish(touched)

    def worker_dropped(self, worker_id: WorkerId) -> None:
        self._publish(self._forget(worker_id))

    def _forget(self, worker_id: WorkerId) -> set[_Key]:
        counts = self._by_worker.pop(worker_id, None)
        if not counts:
            return set()
        self._totals.subtract(counts)
        return set(counts)

    def _publish(self, touched: set[_Key]) -> None:
        if not touched:
            return
        totals = self._totals
        for key in touched:
            bit, tenant = key
            TENANT_CLUSTER_PAGES.labels(TIER_NAMES[bit], tenant).set(max(totals[key], 0))
        for key in [k for k, n in totals.items() if n <= 0]:
            del totals[key]
        for share in self.shares().values():
            TENANT_SHARE_PAGES.labels(share.tenant).set(share.share)

    # ------------------------------------------------------------------ reads

    def pages(self, tenant: str, tier: str | None = None) -> int:
        """Pages `tenant` holds across the cluster, in `tier` or in all tiers."""
        if tier is not None:
            return self._totals.get((TIER_NAMES.index(tier), tenant), 0)
        return sum(n for (_, t), n in self._totals.items() if t == tenant)

    def worker_pages(self, worker_id: WorkerId, tenant: str) -> int:
        """Pages `tenant` holds on one worker, all tiers."""
        counts = self._by_worker.get(worker_id, Counter())
        return sum(n for (_, t), n in counts.items() if t == tenant)

    def shares(self) -> dict[str, TenantShare]:
        """Every tenant holding pages: its pages (by tier) and its fair share of all of them."""
        per_tenant: Counter[str] = Counter()
        by_tier: dict[str, dict[str, int]] = {}
        for (bit, tenant), n in self._totals.items():
            if n > 0:
                per_tenant[tenant] += n
                by_tier.setdefault(tenant, {})[TIER_NAMES[bit]] = n
        fair = self.weights.shares(per_tenant, sum(per_tenant.values()))
        return {t: TenantShare(t, per_tenant[t], fair[t], by_tier[t]) for t in sorted(per_tenant)}

    def over_share(self, tenant: str) -> bool:
        """Whether `tenant` holds more of the cluster's pages than its fair share."""
        share = self.shares().get(tenant)
        return share is not None and share.over_share

    def over_share_pages(self, tenant: str) -> dict[WorkerId, int] | None:
        """The pages `tenant` holds per worker when it is above its share (what `kv_aware`
        weighs as `RouteRequest.tenant_pages`); None when it is not."""
        if not self.over_share(tenant):
            return None
        return {
            wid: n
            for wid, counts in self._by_worker.items()
            if (n := sum(c for (_, t), c in counts.items() if t == tenant))
        }
