"""Per-tenant page counts of the cluster, tracked from the events the index applies."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from kvmesh.config import CoordinatorConfig
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteRequest, WorkerLoad, make_policy
from kvmesh.coordinator.service import Coordinator
from kvmesh.coordinator.tenant_shares import TenantShares
from kvmesh.errors import ConfigError
from kvmesh.events import (
    AllPagesCleared,
    KVEvent,
    PagesRemoved,
    PagesStored,
    decode_batch,
    encode_batch,
    make_batch,
)
from kvmesh.tenants import DEFAULT_TENANT, TenantWeights, tenant_of
from kvmesh.types import PageHash, WorkerId

W0, W1 = WorkerId("w0"), WorkerId("w1")
QUIET, NOISY = tenant_of("quiet-salt"), tenant_of("noisy-salt")


def pages(tag: str, n: int) -> tuple[PageHash, ...]:
    return tuple(PageHash(f"{tag}-{i}".encode()) for i in range(n))


def stored(tag: str, n: int, tenant: str | None, medium: str = "gpu") -> PagesStored:
    return PagesStored(pages(tag, n), None, (), 16, None, medium, tenant)


class Cluster:
    """An index with a `TenantShares` observing it; batches go through the wire encoding."""

    def __init__(self, weights: TenantWeights | None = None) -> None:
        self.index = GlobalIndex()
        self.shares = TenantShares(weights)
        self.index.add_observer(self.shares)
        self.seq = {W0: 0, W1: 0}

    def send(
        self,
        wid: WorkerId,
        events: list[KVEvent],
        *,
        seq: int | None = None,
        snapshot: bool = False,
    ) -> None:
        s = self.seq[wid] if seq is None else seq
        self.index.apply(
            decode_batch(encode_batch(make_batch(events, wid, "i", s, snapshot=snapshot)))
        )
        self.seq[wid] = max(self.seq[wid], s + 1)


def test_pages_are_counted_per_tenant_and_tier_and_follow_moves_between_tiers() -> None:
    c = Cluster()
    c.send(W0, [stored("q", 4, QUIET), stored("n", 6, NOISY)])
    c.send(W1, [stored("n2", 3, NOISY, "cpu")])
    assert (c.shares.pages(QUIET), c.shares.pages(NOISY)) == (4, 9)
    # two of the quiet tenant's pages spill to host memory: stored there, removed from the device
    spill: list[KVEvent] = [
        PagesStored(pages("q", 2), None, (), 16, None, "cpu", QUIET),
        PagesRemoved(pages("q", 2), "gpu", QUIET),
    ]
    c.send(W0, spill)
    assert (c.shares.pages(QUIET, "gpu"), c.shares.pages(QUIET, "cpu")) == (2, 2)
    assert c.shares.pages(QUIET) == 4
    c.send(W0, [PagesRemoved(pages("n", 6), "gpu", NOISY)])
    assert c.shares.pages(NOISY) == 3 and c.shares.worker_pages(W0, NOISY) == 0


def test_duplicates_are_not_counted_twice_and_a_gap_counts_once_it_fills() -> None:
    c = Cluster()
    c.send(W0, [stored("a", 2, QUIET)], seq=0)
    c.send(W0, [stored("a", 2, QUIET)], seq=0)  # a duplicate the index ignores
    assert c.shares.pages(QUIET) == 2
    c.send(W0, [stored("c", 5, QUIET)], seq=2)  # held back: seq 1 is missing
    assert c.shares.pages(QUIET) == 2
    c.send(W0, [stored("b", 1, QUIET)], seq=1)
    assert c.shares.pages(QUIET) == 8


def test_a_snapshot_a_clear_and_a_removed_worker_replace_or_drop_its_counts() -> None:
    c = Cluster()
    c.send(W0, [stored("a", 5, QUIET)])
    c.send(W1, [stored("b", 2, QUIET)])
    c.send(W0, [stored("s", 3, QUIET)], snapshot=True)
    assert c.shares.pages(QUIET) == 5
    c.send(W0, [AllPagesCleared(), stored("t", 1, NOISY)])
    assert (c.shares.pages(QUIET), c.shares.pages(NOISY)) == (2, 1)
    c.index.remove_worker(W1)
    assert c.shares.pages(QUIET) == 0 and QUIET not in c.shares.shares()


def test_removing_pages_never_counted_does_not_go_below_zero_and_untenanted_is_default() -> None:
    c = Cluster()
    c.send(W0, [stored("a", 2, None)])
    c.send(W0, [PagesRemoved(pages("zzz", 7), "gpu", None)])
    assert c.shares.pages(DEFAULT_TENANT) == 0
    c.send(W0, [stored("b", 3, None)])
    assert c.shares.pages(DEFAULT_TENANT) == 3


def test_fair_shares_split_the_cached_pages_by_weight_and_are_published() -> None:
    c = Cluster(TenantWeights({QUIET: 3.0}))
    c.send(W0, [stored("q", 10, QUIET), stored("n", 30, NOISY)])
    c.send(W1, [stored("n1", 20, NOISY, "disk")])
    shares = c.shares.shares()
    assert shares[QUIET].share == pytest.approx(60 * 3 / 4)
    assert shares[NOISY].share == pytest.approx(60 / 4)
    assert shares[NOISY].pages_by_tier == {"gpu": 30, "disk": 20}
    assert c.shares.over_share(NOISY) and not c.shares.over_share(QUIET)
    get = REGISTRY.get_sample_value
    assert get("kvmesh_tenant_cluster_pages", {"tier": "disk", "tenant": NOISY}) == 20
    assert get("kvmesh_tenant_share_pages", {"tenant": QUIET}) == pytest.approx(45)


def test_tenant_names_hide_the_salt_and_bad_weights_say_how_to_write_them() -> None:
    assert tenant_of(None) == tenant_of("") == DEFAULT_TENANT
    assert tenant_of("secret").startswith("t-") and "secret" not in tenant_of("secret")
    assert TenantWeights.parse(" t-a=2, default=0.5 ,").weights == {"t-a": 2.0, "default": 0.5}
    for bad in ("t-a", "t-a=0", "=2", "t-a=x", "t-a=inf"):
        with pytest.raises(ConfigError, match="name=weight"):
            TenantWeights.parse(bad)
    with pytest.raises(ConfigError, match="positive"):
        TenantWeights({"t": -1.0})


def test_the_coordinator_tracks_tenant_shares_from_the_reports_with_configured_weights() -> None:
    coord = Coordinator(CoordinatorConfig(tenant_weights=f"{QUIET}=2"))
    coord.register_worker(WorkerRegistration(W0, "127.0.0.1:1", 100, "i"))
    batch = make_batch([stored("q", 3, QUIET), stored("n", 6, NOISY, "cpu")], W0, "i", 0)
    coord.report(WorkerReport(W0, [encode_batch(batch)]))
    view = coord.tenant_share_view()
    assert (view[QUIET].pages, view[QUIET].share) == (3, pytest.approx(6.0))
    assert view[NOISY].over_share and view[NOISY].pages_by_tier == {"cpu": 6}
    with pytest.raises(ConfigError, match="name=weight"):
        Coordinator(CoordinatorConfig(tenant_weights="quiet"))


def test_an_over_share_tenant_is_routed_where_it_already_holds_pages() -> None:
    c = Cluster()
    c.send(W0, [stored("q", 2, QUIET)])
    c.send(W1, [stored("n", 8, NOISY)])
    assert c.shares.over_share_pages(QUIET) is None
    assert c.shares.over_share_pages(NOISY) == {W1: 8}
    loads = [WorkerLoad(w, free_pages=100, total_pages=100) for w in (W0, W1)]
    request = RouteRequest(pages("new", 4), 4 * 16, 16, tenant_pages={W1: 8})
    policy = make_policy("kv_aware", CoordinatorConfig(tenant_share_weight=0.5), random.Random(0))
    for _ in range(5):  # without the share term the tie would go either way
        d = policy.choose(request, {}, loads)
        assert d.worker_id == W1 and d.cost == pytest.approx(4.0)
    assert policy.choose(replace(request, tenant_pages={}), {}, loads).cost == pytest.approx(6.0)
    off = make_policy("kv_aware", CoordinatorConfig(), random.Random(0))  # the default: off
    assert off.choose(request, {}, loads).cost == pytest.approx(4.0)


def test_the_coordinator_weighs_shares_only_for_a_tenant_above_its_share() -> None:
    coord = Coordinator(CoordinatorConfig(tenant_share_weight=2.0), rng=random.Random(0))
    for wid in (W0, W1):
        coord.register_worker(WorkerRegistration(wid, "127.0.0.1:1", 100, "i"))
    coord.report(WorkerReport(W1, [encode_batch(make_batch([stored("n", 9, NOISY)], W1, "i", 0))]))
    coord.report(WorkerReport(W0, [encode_batch(make_batch([stored("q", 1, QUIET)], W0, "i", 0))]))
    coord.report(WorkerReport(W1, [], WorkerLoad(W1, 2 * 16, free_pages=100, total_pages=100)))
    new = list(pages("fresh", 3))
    # W1 has 2 queued pages; the noisy tenant holds 9 of 10 pages, all on W1: it goes there
    assert coord.route(RouteQuery(new, 3 * 16, tenant=NOISY)).worker_id == W1
    assert coord.route(RouteQuery(new, 3 * 16, tenant=QUIET)).worker_id == W0
    assert coord.route(RouteQuery(new, 3 * 16)).worker_id == W0
