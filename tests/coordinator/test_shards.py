"""The sharded index decides what the single index decides; replicas decide alike (no Ray)."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.app.sim_engine import PreparedTrace, prepare_trace
from kvmesh.config import CoordinatorConfig
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport
from kvmesh.coordinator.policies import RouteRequest, WorkerLoad
from kvmesh.coordinator.service import Coordinator, RouteView
from kvmesh.coordinator.shards import (
    MergedLoads,
    ShardedCoordinator,
    ShardRouter,
    SlowShards,
    merge_view_batches,
    merge_views,
    request_seed,
    shard_of,
)
from kvmesh.errors import InvalidInput, InvalidSetting, NoWorkers
from kvmesh.events import PagesRemoved, PagesStored, encode_batch, make_batch
from kvmesh.trace import load_trace
from kvmesh.types import PageHash, WorkerId
from tests.coordinator.pool_worker_kit import PoolWorker

MAX_PAGES = 48
POOL_PAGES = 96
POLICIES = ("kv_aware", "cache_aware", "consistent_hash", "least_loaded", "random", "round_robin")


@functools.cache
def trace() -> PreparedTrace:
    return prepare_trace(load_trace(limit=400))


def trace_worker(worker_id: str) -> PoolWorker:
    """A worker's side on the trace's pages (16 tokens each)."""
    return PoolWorker(worker_id, POOL_PAGES, "inc-0", page_size=16)


def replay(
    coordinators: Sequence[Coordinator | ShardedCoordinator],
    *,
    workers: int,
    seed: int,
    policy: str,
    start: int,
    requests: int,
) -> int:
    """Route trace requests through every coordinator alike; assert they agree; returns routes."""
    rng = random.Random(seed)
    reqs = trace().requests[start : start + requests]
    pool = [trace_worker(f"w{i}") for i in range(workers)]

    def register(w: PoolWorker) -> None:
        for c in coordinators:
            c.register_worker(
                WorkerRegistration(
                    w.worker_id, f"host:{w.worker_id}", POOL_PAGES - 1, w.incarnation
                )
            )

    def report(w: PoolWorker, data: bytes, load: WorkerLoad | None = None) -> None:
        replies = [c.report(WorkerReport(w.worker_id, [data], load)) for c in coordinators]
        assert all(r == replies[0] for r in replies)

    for w in pool:
        register(w)
    routed = 0
    for n, req in enumerate(reqs):
        hashes = req.page_hashes[: rng.randint(1, MAX_PAGES)]
        w = rng.choice(pool)
        roll = rng.random()
        if roll < 0.05:  # a lost batch: the worker goes stale until its snapshot
            w.serve(trace().requests[rng.randrange(len(trace().requests))].page_hashes[:8])
            w.batch()
        elif roll < 0.10:
            report(w, w.snapshot())
        elif roll < 0.13:  # a restart: a new incarnation replaces the old entries
            w.restart(f"inc-{n}")
            register(w)
        elif roll < 0.15:
            draining = rng.random() < 0.5
            for c in coordinators:
                c.drain_worker(w.worker_id, draining)
        load = WorkerLoad(
            w.worker_id,
            active_prefill_tokens=rng.randrange(0, 4000),
            active_decode_pages=rng.randrange(0, 50),
            free_pages=rng.randrange(0, POOL_PAGES),
            total_pages=POOL_PAGES - 1,
        )
        report(w, w.batch(), load)
        matches = [c.match(hashes) for c in coordinators]
        assert all(m == matches[0] for m in matches), f"request {req.request_id}"
        pull = rng.random() < 0.5
        decisions = [
            c.route(
                RouteQuery(
                    hashes,
                    req.input_tokens,
                    page_size=16,
                    allow_pull=pull,
                    policy=policy,
                    request_id=req.request_id,
                ),
            )
            for c in coordinators
        ]
        assert all(d == decisions[0] for d in decisions), (req.request_id, decisions)
        routed += 1
        chosen = next(x for x in pool if x.worker_id == decisions[0].worker_id)
        chosen.serve(hashes)
        report(chosen, chosen.batch())
    return routed


@settings(max_examples=12, deadline=None)
@given(
    shards=st.integers(2, 5),
    workers=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    policy=st.sampled_from(POLICIES),
    start=st.integers(0, 300),
)
def test_sharded_index_decides_as_the_single_index_on_the_replayed_trace(
    shards: int, workers: int, seed: int, policy: str, start: int
) -> None:
    single = CoordinatorConfig(seed=seed)
    sharded = CoordinatorConfig(seed=seed, index_shards=shards)
    routed = replay(
        [Coordinator(single, clock=lambda: 0.0), ShardedCoordinator(sharded, clock=lambda: 0.0)],
        workers=workers,
        seed=seed,
        policy=policy,
        start=start,
        requests=60,
    )
    assert routed == 60


def test_the_sharded_stats_count_every_shards_workers_and_the_routers_routes() -> None:
    one = Coordinator(CoordinatorConfig(), clock=lambda: 0.0)
    four = ShardedCoordinator(CoordinatorConfig(index_shards=4), clock=lambda: 0.0)
    replay([one, four], workers=7, seed=3, policy="kv_aware", start=0, requests=40)
    single, split = one.stats().as_dict(), four.stats()
    for key in ("workers", "index_entries", "routes", "promised_local_pages", "batches_applied"):
        assert split[key] == single[key], key
    assert split["routes_by_worker"] == single["routes_by_worker"]
    assert sum(len(s.workers()) for s in four.shards) == 7
    assert sum(1 for s in four.shards if s.workers()) > 1  # 7 workers do not all land in one


def test_a_worker_lives_in_one_shard_chosen_by_its_id_alone() -> None:
    ids = [f"worker-{i}" for i in range(64)]
    placed = [shard_of(w, 4) for w in ids]
    assert placed == [shard_of(w, 4) for w in ids]
    assert set(placed) == {0, 1, 2, 3}
    assert all(shard_of(w, 1) == 0 for w in ids)
    with pytest.raises(InvalidInput, match="num_shards"):
        shard_of("w", 0)


def test_merged_views_keep_worker_id_order_for_the_policies_tie_breaks() -> None:
    a = RouteView({WorkerId("w3"): 2}, (WorkerLoad(WorkerId("w1")), WorkerLoad(WorkerId("w3"))))
    b = RouteView({WorkerId("w2"): 5}, (WorkerLoad(WorkerId("w0")), WorkerLoad(WorkerId("w2"))))
    merged = merge_views([a, b])
    assert [x.worker_id for x in merged.loads] == ["w0", "w1", "w2", "w3"]
    assert merged.overlaps == {"w3": 2, "w2": 5}


def _looks(start: int, n: int, policies: Sequence[str], seed: int) -> list[RouteQuery]:
    """Trace requests as looks (no request id: routing them changes no load); those of a
    replay's requests hit what its workers served."""
    rng = random.Random(seed)
    return [
        RouteQuery(
            req.page_hashes[: rng.randint(1, MAX_PAGES)],
            req.input_tokens,
            allow_pull=rng.random() < 0.5,
            policy=rng.choice(policies),
        )
        for req in trace().requests[start : start + n]
    ]


@settings(max_examples=8, deadline=None)
@given(
    shards=st.integers(1, 5),
    workers=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    start=st.integers(0, 300),
)
def test_routes_asked_together_decide_as_the_single_index_routing_them_one_by_one(
    shards: int, workers: int, seed: int, start: int
) -> None:
    single = Coordinator(CoordinatorConfig(seed=seed), clock=lambda: 0.0)
    sharded = ShardedCoordinator(
        CoordinatorConfig(seed=seed, index_shards=shards), clock=lambda: 0.0
    )
    replay(
        [single, sharded], workers=workers, seed=seed, policy="kv_aware", start=start, requests=30
    )
    queries = _looks(start, 40, POLICIES, seed)
    assert any(v.overlaps for v in single.view_many(queries))  # the looks hit
    assert sharded.view_many(queries) == [single.view(q) for q in queries]
    assert sharded.route_many(queries) == [single.route(q) for q in queries]


def _random_index(
    coordinators: Sequence[Coordinator | ShardedCoordinator],
    rng: random.Random,
    workers: int,
    chains: list[list[PageHash]],
    events: int,
) -> None:
    """The same random index in every coordinator: chains stored (whole or in part, in any
    tier) and removed by random workers, with random loads."""
    ids = [WorkerId(f"w{i:02d}") for i in range(workers)]
    seq = dict.fromkeys(ids, 0)
    for c in coordinators:
        for w in ids:
            c.register_worker(WorkerRegistration(w, f"host:{w}", 1_000, "inc-0"))
    for _ in range(events):
        w = rng.choice(ids)
        chain = rng.choice(chains)
        cut = rng.randint(1, len(chain))
        if rng.random() < 0.8:
            medium = rng.choice(("gpu", "gpu", "gpu", "cpu", "disk"))
            tenant = rng.choice((None, "ta", "tb"))
            event: PagesStored | PagesRemoved = PagesStored(
                tuple(chain[:cut]), None, (), 16, None, medium, tenant
            )
        else:
            event = PagesRemoved(tuple(chain[rng.randrange(cut) : cut]), None)
        data = encode_batch(make_batch([event], w, "inc-0", seq[w]))
        seq[w] += 1
        load = WorkerLoad(w, rng.randrange(0, 4000), rng.randrange(0, 50), 500, 1_000)
        for c in coordinators:
            c.report(WorkerReport(w, [data], load))


@settings(max_examples=40, deadline=None)
@given(
    shards=st.integers(1, 5),
    workers=st.integers(1, 20),
    width=st.sampled_from((8, 32)),
    events=st.integers(0, 120),
    batch=st.integers(1, 24),
    seed=st.integers(0, 2**32),
)
def test_a_batch_of_routes_over_shards_picks_what_the_single_index_picks_on_a_random_index(
    shards: int, workers: int, width: int, events: int, batch: int, seed: int
) -> None:
    """`route_many` over N shards (each shard's share of the batch in one vectorized pass:
    `Coordinator.view_table`) decides what the single index decides route by route, for
    random indexes (tiers, tenants, removals, pages held by workers of several shards) and
    prompts (held chains cut anywhere, fresh pages after them, several lengths, tenants
    weighed against their share or not)."""
    rng = random.Random(seed)
    chains = [
        [PageHash(rng.randbytes(width)) for _ in range(rng.randint(1, 24))] for _ in range(12)
    ]
    config = CoordinatorConfig(seed=seed, policy="kv_aware", tenant_share_weight=seed % 2 * 0.5)
    single = Coordinator(config, clock=lambda: 0.0)
    sharded = ShardedCoordinator(replace(config, index_shards=shards), clock=lambda: 0.0)
    _random_index([single, sharded], rng, workers, chains, events)
    queries = []
    for _ in range(batch):
        chain = rng.choice(chains)
        hashes = chain[: rng.randint(0, len(chain))]
        hashes += [PageHash(rng.randbytes(width)) for _ in range(rng.randint(0, 3))]
        hashes = hashes or chain[:1]
        queries.append(
            RouteQuery(
                hashes,
                16 * len(hashes),
                allow_pull=rng.random() < 0.5,
                policy=rng.choice(POLICIES[:4]),
                tenant=rng.choice((None, None, "ta", "tb")),
            )
        )
    views = [single.view(q) for q in queries]
    assert sharded.view_many(queries) == views
    assert [sharded.view(q) for q in queries] == views  # one per call: shards merged as parts
    assert sharded.route_many(queries) == [single.route(q) for q in queries]


def test_a_batch_merges_each_roles_loads_once_and_as_merge_views_does() -> None:
    sharded = ShardedCoordinator(CoordinatorConfig(index_shards=3), clock=lambda: 0.0)
    replay([sharded], workers=7, seed=2, policy="kv_aware", start=0, requests=20)
    queries = _looks(0, 12, ["kv_aware"], 2)
    batch = sharded.view_many(queries)
    assert batch == [sharded.view(q) for q in queries]
    assert len({id(v.loads) for v in batch}) == 1  # merged once, shared by the batch's views
    per_shard = [s.view_many(queries) for s in sharded.shards]
    assert merge_view_batches(per_shard) == [merge_views(vs) for vs in zip(*per_shard, strict=True)]


def test_requests_routed_together_count_in_their_workers_loads_after_the_batch() -> None:
    sharded = ShardedCoordinator(CoordinatorConfig(index_shards=2), clock=lambda: 0.0)
    replay([sharded], workers=4, seed=4, policy="kv_aware", start=0, requests=10)
    looks = _looks(0, 6, ["least_loaded"], 4)
    before = {x.worker_id: x.active_prefill_tokens for x in sharded.view(looks[0]).loads}
    routed = [replace(q, request_id=f"r{i}") for i, q in enumerate(looks)]
    decisions = sharded.route_many(routed)
    # every route of the batch saw the loads as they were when it was asked ...
    assert len({d.worker_id for d in decisions}) == 1
    after = {x.worker_id: x.active_prefill_tokens for x in sharded.view(looks[0]).loads}
    # ... and each counts in its worker's load from then on
    grown = {w: after[w] - before[w] for w in after if after[w] != before[w]}
    assert set(grown) == {decisions[0].worker_id}
    assert grown[decisions[0].worker_id] > 0


def test_a_bad_query_in_a_batch_is_refused_before_any_route_is_decided() -> None:
    sharded = ShardedCoordinator(CoordinatorConfig(index_shards=2), clock=lambda: 0.0)
    replay([sharded], workers=3, seed=1, policy="kv_aware", start=0, requests=5)
    routes_before = sharded.stats()["routes"]
    good = _looks(0, 3, ["kv_aware"], 1)
    bad = replace(good[0])
    object.__setattr__(bad, "page_size", 0)  # as if unpickled past its constructor's check
    with pytest.raises(InvalidInput, match="page_size"):
        sharded.route_many([*good, bad])
    assert sharded.stats()["routes"] == routes_before


def test_a_sharded_coordinator_without_workers_refuses_to_route() -> None:
    with pytest.raises(NoWorkers):
        ShardedCoordinator(CoordinatorConfig(index_shards=3)).route(
            RouteQuery([PageHash(b"h" * 16)], 16)
        )


def test_replicas_fed_the_same_events_decide_alike_on_10000_random_requests() -> None:
    """Two replicas see the same events and loads but each routes a different mix of requests.

    What one replica decided must not change what the other decides: the
    random tie-breaks are drawn from the request (`request_seed`).
    """
    config = CoordinatorConfig(index_shards=2, temperature=0.5, seed=11)
    a = ShardedCoordinator(config, clock=lambda: 0.0, per_request_rng=True)
    b = ShardedCoordinator(config, clock=lambda: 0.0, per_request_rng=True)
    rng = random.Random(5)
    pool = [trace_worker(f"w{i}") for i in range(6)]
    for w in pool:
        for c in (a, b):
            c.register_worker(WorkerRegistration(w.worker_id, "h", POOL_PAGES - 1, w.incarnation))
    reqs = trace().requests
    agreed = 0
    for n in range(10_000):
        w = pool[n % len(pool)]
        if n % 10 == 0:
            w.serve(reqs[rng.randrange(len(reqs))].page_hashes[:MAX_PAGES])
            data = w.batch()
            load = WorkerLoad(w.worker_id, active_prefill_tokens=rng.randrange(0, 3000))
            for c in (a, b):
                c.report(WorkerReport(w.worker_id, [data], load))
        req = reqs[rng.randrange(len(reqs))]
        hashes = req.page_hashes[: rng.randint(1, MAX_PAGES)]
        only_a = rng.random() < 0.3  # a's own history: looks b never sees
        da = a.route(RouteQuery(hashes, req.input_tokens, request_id=f"r{n}", policy="kv_aware"))
        if only_a:
            # a routed it alone; its load reaches every replica as a state change (RouterActor)
            routed = RouteRequest(tuple(hashes), req.input_tokens, request_id=f"r{n}")
            b.shard(da.worker_id).count_routed(da, routed)
            # and a look (no request id: no load counts it) that b never sees
            a.route(RouteQuery(hashes[:1], 16, policy="random"))
            continue
        db = b.route(RouteQuery(hashes, req.input_tokens, request_id=f"r{n}", policy="kv_aware"))
        assert da == db, n
        agreed += 1
    assert agreed > 6000


def test_a_request_seed_depends_on_the_request_only() -> None:
    a, b, c = (PageHash(x * 16) for x in (b"a", b"b", b"c"))
    r1 = RouteRequest((a, b), 40, 16, False, "x")
    r2 = RouteRequest((a, b), 40, 16, False, "x")
    r3 = RouteRequest((a, c), 40, 16, False, "x")
    assert request_seed(1, r1) == request_seed(1, r2)
    assert request_seed(1, r1) != request_seed(1, r3)
    assert request_seed(1, r1) != request_seed(2, r1)


def test_a_router_refuses_an_unknown_policy_by_name() -> None:
    router = ShardRouter(CoordinatorConfig())
    view = RouteView({}, (WorkerLoad(WorkerId("w0")),))
    with pytest.raises(Exception, match="nope"):
        router.decide(RouteQuery((), 1, policy="nope"), view)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("index_shards", 0, "must be positive"),
        ("router_replicas", 0, "must be positive"),
        ("api_port", 70_000, "TCP port"),
        ("api_port", -2, "TCP port"),
        ("api_deadline_s", 0.0, "must be positive"),
    ],
)
def test_a_bad_scale_setting_is_refused_naming_the_field(
    field: str, value: object, reason: str
) -> None:
    with pytest.raises(InvalidSetting, match=f"CoordinatorConfig.{field}=.*{reason}"):
        CoordinatorConfig(**{field: value})  # type: ignore[arg-type]


def test_a_slow_shard_is_asked_everywhere_until_its_hold_passes() -> None:
    now = [100.0]
    slow = SlowShards(1.0, clock=lambda: now[0])
    assert not slow.is_slow(0)
    slow.mark(0)
    assert slow.is_slow(0)
    assert not slow.is_slow(1)  # per shard
    now[0] += 0.99
    assert slow.is_slow(0)
    now[0] += 0.02
    assert not slow.is_slow(0)


def test_a_slow_shard_that_answers_first_again_is_asked_alone() -> None:
    slow = SlowShards(60.0, clock=lambda: 0.0)
    slow.mark(2)
    slow.clear(2)
    assert not slow.is_slow(2)
    slow.clear(3)  # never marked: nothing to clear
    assert not slow.is_slow(3)


def test_a_mark_while_slow_extends_the_hold() -> None:
    now = [0.0]
    slow = SlowShards(1.0, clock=lambda: now[0])
    slow.mark(0)
    now[0] = 0.8
    slow.mark(0)
    now[0] = 1.5
    assert slow.is_slow(0)


def test_a_negative_hold_is_refused() -> None:
    with pytest.raises(InvalidInput, match="hold_s"):
        SlowShards(-1.0)


def test_merged_loads_are_merged_again_only_when_a_shards_loads_change() -> None:
    sharded = ShardedCoordinator(CoordinatorConfig(index_shards=3), clock=lambda: 0.0)
    replay([sharded], workers=7, seed=3, policy="kv_aware", start=0, requests=20)
    look = _looks(0, 1, ["kv_aware"], 3)[0]
    first = sharded.view(look)
    assert sharded.view(look).loads is first.loads  # kept: no shard's loads changed
    worker = first.loads[0].worker_id
    sharded.heartbeat(worker, WorkerLoad(worker, 12_345))
    again = sharded.view(look)
    assert again.loads is not first.loads
    assert again.loads == merge_views([s.view(look) for s in sharded.shards]).loads
    assert {x.worker_id: x.active_prefill_tokens for x in again.loads}[worker] == 12_345


def test_a_merged_loads_cache_keeps_its_size_and_refuses_none() -> None:
    views = [RouteView({}, (WorkerLoad(WorkerId(f"w{i}")),)) for i in range(3)]
    cache = MergedLoads(size=2)
    for k in range(4):  # four different shard pairs: the oldest merges go
        assert [x.worker_id for x in cache.of([views[k % 3], views[(k + 1) % 3]])] == sorted(
            [f"w{k % 3}", f"w{(k + 1) % 3}"]
        )
    assert len(cache._merged) == 2
    with pytest.raises(InvalidInput, match="size"):
        MergedLoads(size=0)
