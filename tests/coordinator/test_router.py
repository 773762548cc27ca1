"""Index shards and router replicas on a real local Ray cluster.

Workers are small Ray actors owning a real `PagePool` (the worker side of
the contract in `kvmesh.coordinator.service`), reporting through router
replica 0 as real workers do; every route answer is checked against what
the pools really hold.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from kvmesh.config import CoordinatorConfig  # noqa: E402
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport  # noqa: E402
from kvmesh.coordinator.actor import get_or_create_coordinator  # noqa: E402
from kvmesh.coordinator.router import HedgeDelay, create_layout  # noqa: E402
from kvmesh.coordinator.shards import shard_of  # noqa: E402
from kvmesh.errors import InvalidInput, KVMeshError  # noqa: E402
from kvmesh.events import encode_batch, make_batch  # noqa: E402
from kvmesh.hashing import PageHasher  # noqa: E402
from kvmesh.load import WorkerLoad  # noqa: E402
from kvmesh.router_replicas import router_handles, shard_actor_name  # noqa: E402
from kvmesh.types import PageHash, WorkerId  # noqa: E402
from kvmesh.worker.page_pool import PagePool  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

PAGE = 4
HASHER = PageHasher(PAGE)
PROMPTS = [HASHER.hash_prompt([t * 1000 + i for i in range(12 * PAGE)]) for t in range(8)]


class PoolWorker:
    """A worker actor: a real pool, one seq counter, snapshots take the next seq."""

    def __init__(self, worker_id: str, coordinator: Any, actor_name: str, ns: str) -> None:
        self.worker_id = WorkerId(worker_id)
        self.coordinator = coordinator
        self.actor_name = actor_name
        self.namespace = ns
        self.incarnation = uuid.uuid4().hex
        self.pool = PagePool(256, page_size=PAGE)
        self.seq = 0

    def _batch(self, snapshot: bool = False) -> bytes:
        events = self.pool.take_events()
        if snapshot:
            events = list(self.pool.snapshot_events())
        data = encode_batch(
            make_batch(events, self.worker_id, self.incarnation, self.seq, snapshot=snapshot)
        )
        self.seq += 1
        return data

    def register(self) -> None:
        ray.get(
            self.coordinator.register_worker.remote(
                WorkerRegistration(
                    self.worker_id,
                    f"addr-{self.worker_id}",
                    self.pool.num_pages - 1,
                    self.incarnation,
                    "both",
                    self.actor_name,
                    self.namespace,
                ),
            )
        )
        ray.get(self.coordinator.report.remote(WorkerReport(self.worker_id, [self._batch(True)])))

    def serve(self, prompts: list[list[PageHash]], load: int = 0) -> None:
        for hashes in prompts:
            hit = self.pool.match_prefix(hashes, len(hashes))
            self.pool.touch(hit)
            pages = hit + self.pool.get_new_pages(len(hashes) - len(hit))
            self.pool.cache_full_pages(pages, hashes, len(hit), len(hashes))
            self.pool.free_pages(list(reversed(pages)))
        wl = WorkerLoad(self.worker_id, active_prefill_tokens=load, total_pages=255, free_pages=255)
        ray.get(self.coordinator.report.remote(WorkerReport(self.worker_id, [self._batch()], wl)))

    def snapshot(self) -> bytes:
        return self._batch(snapshot=True)

    def cached(self) -> set[PageHash]:
        return self.pool.cached_hashes()


cloudpickle = pytest.importorskip("ray.cloudpickle")
cloudpickle.register_pickle_by_value(sys.modules[__name__])
RemoteWorker = ray.remote(num_cpus=0)(PoolWorker)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def layout(shards: int, replicas: int) -> CoordinatorConfig:
    return CoordinatorConfig(
        namespace=f"t{uuid.uuid4().hex[:8]}",
        index_shards=shards,
        router_replicas=replicas,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=30.0,
    )


def start_workers(cfg: CoordinatorConfig, router: Any, n: int) -> list[Any]:
    workers = []
    for i in range(n):
        name = f"w{i}-{cfg.namespace}"
        workers.append(
            RemoteWorker.options(name=name, namespace=cfg.namespace).remote(
                f"w{i}", router, name, cfg.namespace
            )
        )
    ray.get([w.register.remote() for w in workers], timeout=60)
    for i, w in enumerate(workers):  # each worker holds a different prefix of each prompt
        ray.get(w.serve.remote([p[: 2 + (i * 3 + j) % 10] for j, p in enumerate(PROMPTS)]))
    return workers


def truth(workers: Sequence[Any]) -> dict[str, set[PageHash]]:
    return {f"w{i}": ray.get(w.cached.remote()) for i, w in enumerate(workers)}


@dataclasses.dataclass(frozen=True)
class OneRouter:
    """A router replica, its config, the workers it registered (held here: Ray collects
    actors no one holds) and what each worker's pool holds."""

    cfg: CoordinatorConfig
    router: Any
    workers: list[Any]
    held: dict[str, set[PageHash]]

    def shard(self, s: int) -> Any:
        return ray.get_actor(shard_actor_name(self.cfg, 0, s), namespace=self.cfg.namespace)


def one_router(shards: int, n_workers: int) -> OneRouter:
    """A ready router (one replica) over `shards` index shards, with `n_workers` workers
    registered through it, each holding a different prefix of each of `PROMPTS`."""
    cfg = layout(shards=shards, replicas=1)
    router = get_or_create_coordinator(cfg)
    assert ray.get(router.wait_ready.remote(60), timeout=90)
    workers = start_workers(cfg, router, n_workers)
    return OneRouter(cfg, router, workers, truth(workers))


def held_prefix(held: set[PageHash], hashes: Sequence[PageHash]) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


def check(decision: Any, hashes: Sequence[PageHash], held: dict[str, set[PageHash]]) -> None:
    """A right answer: the chosen worker holds exactly the prefix the decision promises."""
    assert decision.local_pages == held_prefix(held[decision.worker_id], hashes), decision
    if decision.peer_id is not None:
        peer = held_prefix(held[decision.peer_id], hashes)
        assert peer == decision.local_pages + decision.peer_pages, decision


def test_a_sharded_coordinator_routes_on_every_shards_workers(ray_cluster: None) -> None:
    mesh = one_router(shards=3, n_workers=6)
    for p in PROMPTS:
        d = ray.get(mesh.router.route.remote(RouteQuery(p, len(p) * PAGE, PAGE, True)))
        check(d, p, mesh.held)
        best = max(held_prefix(h, p) for h in mesh.held.values())
        assert d.local_pages + d.peer_pages == best  # the longest prefix anywhere is found
    per_shard = []
    for s in range(3):
        per_shard.append({i.worker_id for i in ray.get(mesh.shard(s).workers.remote())})
    assert set().union(*per_shard) == {f"w{i}" for i in range(6)}
    assert sum(len(p) for p in per_shard) == 6  # each worker in exactly one shard
    for s, ids in enumerate(per_shard):
        assert all(shard_of(w, 3) == s for w in ids)
    stats = ray.get(mesh.router.stats.remote())
    assert (stats["workers"], stats["routes"], stats["shards"]) == (6, len(PROMPTS), 3)


def test_a_shard_killed_mid_load_is_rebuilt_and_routing_resumes_with_no_wrong_answer(
    ray_cluster: None,
) -> None:
    mesh = one_router(shards=2, n_workers=4)
    victim = mesh.shard(1)
    old_pid = ray.get(victim.pid.remote())
    answers: list[tuple[Any, list[PageHash]]] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def load() -> None:
        rng = random.Random(1)
        while not stop.is_set():
            p = PROMPTS[rng.randrange(len(PROMPTS))]
            try:
                answers.append(
                    (ray.get(mesh.router.route.remote(RouteQuery(p, len(p) * PAGE, PAGE, True))), p)
                )
            except Exception as exc:  # counted: the test wants none
                failures.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(1.0)
    before = len(answers)
    ray.kill(victim, no_restart=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if ray.get(victim.pid.remote(), timeout=5) != old_pid:
                break
        except Exception:
            time.sleep(0.2)
    time.sleep(2.0)
    stop.set()
    thread.join(60)
    assert not failures
    assert len(answers) > before  # routing resumed after the kill
    for d, p in answers:
        check(d, p, mesh.held)


def test_two_replicas_fed_the_same_events_decide_alike(ray_cluster: None) -> None:
    cfg = layout(shards=2, replicas=2)
    keep = get_or_create_coordinator(cfg)  # replica 0 holds replica 1's router
    r0, r1 = router_handles(cfg)
    assert r0 == keep
    assert ray.get([r0.wait_ready.remote(60), r1.wait_ready.remote(60)], timeout=90) == [True] * 2
    workers = start_workers(cfg, r0, 5)
    held = truth(workers)
    rng = random.Random(7)
    reqs = []
    for _ in range(10_000):
        p = PROMPTS[rng.randrange(len(PROMPTS))][: rng.randint(1, 12)]
        # no request id: looks, which no worker's load counts; each replica is asked the same
        # looks (a request on its way is routed once and counts everywhere: the test below)
        reqs.append((p, len(p) * PAGE + rng.randrange(PAGE), ""))
    batch = 500
    for k in range(0, len(reqs), batch):
        part = reqs[k : k + batch]
        a = ray.get(
            [r0.route.remote(RouteQuery(p, t, PAGE, True, None, None, rid)) for p, t, rid in part]
        )
        b = ray.get(
            [r1.route.remote(RouteQuery(p, t, PAGE, True, None, None, rid)) for p, t, rid in part]
        )
        assert a == b
        for d, (p, _, _) in zip(a, part, strict=True):
            check(d, p, held)
        # every worker reports (as its heartbeat would), and the load moves: both replicas
        # see the same reports. (A worker that stops reporting expires on each replica's
        # own clock: docs/scale.md, what replicas may disagree on.)
        ray.get([w.serve.remote([], load=rng.randrange(0, 400)) for w in workers])


def test_a_request_routed_by_one_replica_counts_in_every_replicas_loads(
    ray_cluster: None,
) -> None:
    cfg = layout(shards=2, replicas=2)
    keep = get_or_create_coordinator(cfg)
    r0, r1 = router_handles(cfg)
    assert ray.get([r0.wait_ready.remote(60), r1.wait_ready.remote(60)], timeout=90) == [True] * 2
    _workers = start_workers(cfg, keep, 3)  # held until the end: Ray collects unheld actors
    prompt = PROMPTS[0]
    tokens = len(prompt) * PAGE
    d = ray.get(r0.route.remote(RouteQuery(prompt, tokens, PAGE, False, None, None, "req-1")))
    want = tokens - d.local_pages * PAGE  # what the single coordinator adds (`_count_routed`)

    def queued(router: Any) -> int:
        infos = ray.get(router.workers.remote())
        return next(i.load.active_prefill_tokens for i in infos if i.worker_id == d.worker_id)

    deadline = time.monotonic() + 30  # the increment goes out off the reply path
    while queued(r1) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert queued(r1) == want
    assert queued(r0) == want


def test_a_replica_killed_under_load_from_8_clients_fails_no_request(ray_cluster: None) -> None:
    cfg = layout(shards=2, replicas=2)
    routers = create_layout(cfg)
    assert ray.get([r.wait_ready.remote(60) for r in routers], timeout=90) == [True] * 2
    workers = start_workers(cfg, routers[0], 4)
    held = truth(workers)
    done: list[int] = [0] * 8
    failures: list[BaseException] = []
    stop = threading.Event()

    def client(k: int) -> None:
        rng = random.Random(k)
        order = [routers[k % 2], routers[(k + 1) % 2]]  # half start on each replica
        while not stop.is_set():
            p = PROMPTS[rng.randrange(len(PROMPTS))]
            for i, r in enumerate(order):
                try:
                    d = ray.get(
                        r.route.remote(RouteQuery(p, len(p) * PAGE, PAGE, True)), timeout=30
                    )
                    check(d, p, held)
                    done[k] += 1
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                    if i == len(order) - 1:
                        failures.append(exc)
                    order = order[1:] + order[:1]  # fail over; stay on the live one
                except (AssertionError, KVMeshError) as exc:
                    failures.append(exc)
                    break

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    before = sum(done)
    ray.kill(routers[1], no_restart=True)  # replica 1's router is gone for good
    time.sleep(2.5)
    stop.set()
    for t in threads:
        t.join(60)
    assert not failures
    assert sum(done) > before
    assert all(n > 0 for n in done)


def test_a_new_replica_catches_up_from_snapshots_before_it_routes(ray_cluster: None) -> None:
    cfg = layout(shards=2, replicas=1)
    (r0,) = create_layout(cfg)
    workers = start_workers(cfg, r0, 4)
    held = truth(workers)
    _, r1 = create_layout(dataclasses.replace(cfg, router_replicas=2))
    assert ray.get(r1.wait_ready.remote(60), timeout=90)
    # looks (no request id), so that asking both replicas the same adds no load twice
    for p in PROMPTS:  # routes only once caught up: the pools' truth, as replica 0
        d1 = ray.get(r1.route.remote(RouteQuery(p, len(p) * PAGE, PAGE, True, None, None, "")))
        d0 = ray.get(r0.route.remote(RouteQuery(p, len(p) * PAGE, PAGE, True, None, None, "")))
        check(d1, p, held)
        assert d1 == d0
    time.sleep(3 * cfg.heartbeat_interval_s)  # replica 0's router finds replica 1
    for i, w in enumerate(workers):
        ray.get(w.serve.remote([PROMPTS[i][:12]]))
    held = truth(workers)
    deadline = time.monotonic() + 30
    while True:  # a gap from before it was found heals by snapshot; then both agree
        a = [
            ray.get(r0.route.remote(RouteQuery(p, 48, PAGE, True, None, None, ""))) for p in PROMPTS
        ]
        b = [
            ray.get(r1.route.remote(RouteQuery(p, 48, PAGE, True, None, None, ""))) for p in PROMPTS
        ]
        if a == b or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert a == b
    for d, p in zip(b, PROMPTS, strict=True):
        check(d, p, held)


def test_the_routers_serve_the_grpc_api_and_a_client_fails_over(ray_cluster: None) -> None:
    """An engine outside Ray registers and reports over gRPC; its client survives router 0."""
    from kvmesh.client.routing_client import RoutingClient
    from kvmesh.config import TransferConfig
    from kvmesh.events import PagesStored

    cfg = dataclasses.replace(layout(shards=2, replicas=2), api_port=0)
    security = TransferConfig(auth_token="t0ken")
    routers = create_layout(cfg, security)
    assert ray.get([r.wait_ready.remote(60) for r in routers], timeout=90) == [True] * 2
    addresses = ray.get([r.api_address.remote() for r in routers], timeout=60)
    with RoutingClient(addresses, security, deadline_s=10) as client:
        assert client.health().replicas == 2
        for i in range(3):
            client.register(
                WorkerRegistration(f"engine-{i}", f"http://engine-{i}:8000", 1000, "boot")
            )
            events = [PagesStored(tuple(PROMPTS[0][: 3 + 3 * i]), None, (), PAGE)]
            batch = encode_batch(make_batch(events, WorkerId(f"engine-{i}"), "boot", 0))
            assert client.report(WorkerReport(f"engine-{i}", [batch])) == (False, ["applied"])
        got = client.route(RouteQuery(PROMPTS[0], 48, page_size=PAGE))
        assert (got.worker_id, got.matched_pages, got.worker_address) == (
            "engine-2",
            9,
            "http://engine-2:8000",
        )
        ray.kill(routers[0], no_restart=True)
        again = client.route(RouteQuery(PROMPTS[0], 48, page_size=PAGE))
        assert (again.worker_id, again.matched_pages) == ("engine-2", 9)
        assert again.router == addresses[1]


def test_the_single_coordinator_actor_serves_the_grpc_api_too(ray_cluster: None) -> None:
    from kvmesh.client.routing_client import RoutingClient

    cfg = CoordinatorConfig(namespace=f"t{uuid.uuid4().hex[:8]}", api_port=0)
    coordinator = get_or_create_coordinator(cfg)
    address = ray.get(coordinator.api_address.remote(), timeout=60)
    workers = start_workers(cfg, coordinator, 2)
    held = truth(workers)
    with RoutingClient(address) as client:
        assert client.health().shards == 1
        for p in PROMPTS:
            got = client.route(RouteQuery(p, len(p) * PAGE, page_size=PAGE))
            assert got.matched_pages == held_prefix(held[got.worker_id], p)
            assert got.worker_address == f"addr-{got.worker_id}"


def test_routes_arriving_together_go_to_each_shard_in_one_call_and_decide_as_one_by_one(
    ray_cluster: None,
) -> None:
    mesh = one_router(shards=3, n_workers=6)
    rng = random.Random(5)
    looks = []
    for _ in range(300):
        p = PROMPTS[rng.randrange(len(PROMPTS))][: rng.randint(1, 12)]
        policy = rng.choice([None, "least_loaded", "cache_aware"])
        looks.append(RouteQuery(p, len(p) * PAGE + rng.randrange(PAGE), PAGE, True, None, policy))
    one_by_one = [ray.get(mesh.router.route.remote(q)) for q in looks]
    shards = [mesh.shard(s) for s in range(3)]
    before = [ray.get(s.calls.remote()).get("view_many", 0) for s in shards]
    together = ray.get([mesh.router.route.remote(q) for q in looks])
    after = [ray.get(s.calls.remote()).get("view_many", 0) for s in shards]
    calls = [a - b for a, b in zip(after, before, strict=True)]
    assert together == one_by_one  # looks change no load: arriving together changes nothing
    for d, q in zip(together, looks, strict=True):
        check(d, q.hashes, mesh.held)
    assert all(0 < n < len(looks) for n in calls), calls  # batched: fewer calls than routes


def test_a_bad_route_among_routes_arriving_together_fails_alone(ray_cluster: None) -> None:
    mesh = one_router(shards=2, n_workers=3)
    good = [RouteQuery(p, len(p) * PAGE, PAGE, True) for p in PROMPTS * 4]
    bad = dataclasses.replace(good[0])
    object.__setattr__(bad, "hashes", [*good[0].hashes[:2], "not bytes"])  # past its checks
    refs = [mesh.router.route.remote(q) for q in good[:10]]
    bad_ref = mesh.router.route.remote(bad)
    refs += [mesh.router.route.remote(q) for q in good[10:]]
    with pytest.raises(InvalidInput, match="page hash must be 1-64 bytes"):
        ray.get(bad_ref)
    for d, q in zip(ray.get(refs), good, strict=True):
        check(d, q.hashes, mesh.held)


def test_routes_cancelled_while_they_wait_for_a_batch_leave_the_others_answered(
    ray_cluster: None,
) -> None:
    mesh = one_router(shards=2, n_workers=3)
    looks = [RouteQuery(p, len(p) * PAGE, PAGE, True) for p in PROMPTS * 16]
    refs = [mesh.router.route.remote(q) for q in looks]
    gone = {3, 40, 41, 97}
    for i in gone:
        ray.cancel(refs[i])
    for i, (ref, q) in enumerate(zip(refs, looks, strict=True)):
        try:
            check(ray.get(ref, timeout=60), q.hashes, mesh.held)
        except ray.exceptions.TaskCancelledError:
            assert i in gone
    check(ray.get(mesh.router.route.remote(looks[0]), timeout=60), looks[0].hashes, mesh.held)


def test_a_router_routes_on_each_shards_loads_as_they_change(ray_cluster: None) -> None:
    """The router keeps each shard's loads while their version holds; every report that
    moves them reaches the next route."""
    mesh = one_router(shards=2, n_workers=4)
    look = RouteQuery(PROMPTS[0][:3], 3 * PAGE, PAGE, True, None, "least_loaded")

    def least_loaded_after(loads: list[int]) -> str:
        ray.get([w.serve.remote([], load=n) for w, n in zip(mesh.workers, loads, strict=True)])
        first = ray.get(mesh.router.route.remote(look))
        assert ray.get(mesh.router.route.remote(look)) == first  # held loads: the same answer
        return str(first.worker_id)

    assert least_loaded_after([10, 20, 30, 40]) == "w0"
    assert least_loaded_after([10**6, 20, 30, 40]) == "w1"
    assert least_loaded_after([10**6, 10**6, 30, 5]) == "w3"
    assert least_loaded_after([0, 10**6, 30, 5]) == "w0"


def test_a_hedge_waits_the_ceiling_for_a_shard_never_heard_from() -> None:
    hedge = HedgeDelay(floor_s=0.05, ceiling_s=0.25, factor=4.0)
    assert hedge.delay(0) == 0.25


def test_a_hedge_waits_four_times_a_shards_usual_answer_within_floor_and_ceiling() -> None:
    hedge = HedgeDelay(floor_s=0.05, ceiling_s=0.25, factor=4.0, weight=0.5)
    hedge.observe(0, 0.02)
    assert hedge.delay(0) == pytest.approx(0.08)
    hedge.observe(0, 0.04)  # moving average: 0.03
    assert hedge.delay(0) == pytest.approx(0.12)
    hedge.observe(1, 0.001)
    assert hedge.delay(1) == 0.05  # the floor: ordinary jitter must not hedge every route
    hedge.observe(2, 1.0)
    assert hedge.delay(2) == 0.25  # the ceiling
    assert hedge.delay(0) == pytest.approx(0.12)  # per shard


def test_a_bad_hedge_setting_is_refused() -> None:
    with pytest.raises(InvalidInput, match="floor_s"):
        HedgeDelay(floor_s=0.5, ceiling_s=0.25)
