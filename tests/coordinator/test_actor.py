"""The coordinator actor on a real local Ray cluster: restart + rebuild, expiry.

Workers here are small Ray actors owning a real `PagePool`; they speak the
worker side of the contract in `kvmesh.coordinator.service` (register, report
encoded batches with seqs from 0, answer `snapshot()` with the next seq).
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from kvmesh.config import CoordinatorConfig  # noqa: E402
from kvmesh.coordination import RouteQuery, WorkerRegistration, WorkerReport  # noqa: E402
from kvmesh.coordinator.actor import get_or_create_coordinator  # noqa: E402
from kvmesh.coordinator.index import GlobalIndex  # noqa: E402
from kvmesh.errors import UnknownWorker  # noqa: E402
from kvmesh.events import encode_batch, make_batch  # noqa: E402
from kvmesh.hashing import PageHasher  # noqa: E402
from kvmesh.requests import ReportMark  # noqa: E402
from kvmesh.types import PageHash, WorkerId  # noqa: E402
from kvmesh.worker.page_pool import PagePool  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

PAGE = 4
HASHER = PageHasher(PAGE)


def prompt(n_pages: int, tag: int) -> list[PageHash]:
    return HASHER.hash_prompt([tag * 1000 + i for i in range(n_pages * PAGE)])


class PoolWorker:
    """A worker actor: real pool, one seq counter, snapshots take the next seq."""

    def __init__(self, worker_id: str, coordinator: Any, actor_name: str | None, ns: str) -> None:
        self.worker_id = WorkerId(worker_id)
        self.coordinator = coordinator
        self.actor_name = actor_name
        self.namespace = ns
        self.incarnation = uuid.uuid4().hex
        self.pool = PagePool(64, page_size=PAGE)
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

    def register(self) -> bool:
        reg = ray.get(
            self.coordinator.register_worker.remote(
                WorkerRegistration(
                    self.worker_id,
                    "127.0.0.1:0",
                    self.pool.num_pages - 1,
                    self.incarnation,
                    "both",
                    self.actor_name,
                    self.namespace,
                ),
            )
        )
        return bool(reg.needs_snapshot)

    def serve(self, prompts: list[list[PageHash]]) -> bool:
        """Run prompts through the pool and report their events; returns needs_snapshot."""
        for hashes in prompts:
            hit = self.pool.match_prefix(hashes, len(hashes))
            self.pool.touch(hit)
            pages = hit + self.pool.get_new_pages(len(hashes) - len(hit))
            self.pool.cache_full_pages(pages, hashes, len(hit), len(hashes))
            self.pool.free_pages(list(reversed(pages)))
        reply = ray.get(
            self.coordinator.report.remote(WorkerReport(self.worker_id, [self._batch()]))
        )
        return bool(reply.needs_snapshot)

    def send_snapshot(self) -> bool:
        reply = ray.get(
            self.coordinator.report.remote(WorkerReport(self.worker_id, [self._batch(True)]))
        )
        return bool(reply.needs_snapshot)

    def snapshot(self) -> bytes:
        return self._batch(snapshot=True)

    def cached(self) -> set[PageHash]:
        return self.pool.cached_hashes()

    def incarnation_of(self) -> str:
        return self.incarnation


# Ray workers cannot import this test module by name: ship it by value.
cloudpickle = pytest.importorskip("ray.cloudpickle")
cloudpickle.register_pickle_by_value(sys.modules[__name__])
RemoteWorker = ray.remote(num_cpus=0)(PoolWorker)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def index_of(coordinator: Any) -> GlobalIndex:
    index = GlobalIndex()
    index.restore(ray.get(coordinator.snapshot_index.remote(), timeout=30))
    return index


def wait_until_ready(coordinator: Any, deadline_s: float = 90.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            if ray.get(coordinator.wait_ready.remote(5.0), timeout=30):
                return
        except ray.exceptions.RayActorError:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


def ready_coordinator(**settings: Any) -> tuple[CoordinatorConfig, Any]:
    """A coordinator actor in a namespace of its own (tests never see each other's
    workers), with `settings`, once it is ready to route."""
    cfg = CoordinatorConfig(namespace=f"kvmesh-test-{uuid.uuid4().hex[:8]}", **settings)
    coord = get_or_create_coordinator(cfg)
    wait_until_ready(coord)
    return cfg, coord


def test_a_killed_coordinator_is_restarted_and_rebuilds_the_same_index(ray_cluster: None) -> None:
    cfg, coord = ready_coordinator(
        heartbeat_interval_s=0.2, heartbeat_timeout_s=120.0, max_restarts=2
    )
    ns = cfg.namespace
    named = [
        RemoteWorker.options(name=f"w{i}", namespace=ns).remote(f"w{i}", coord, f"w{i}", ns)
        for i in range(2)
    ]
    anonymous = RemoteWorker.remote("anon", coord, None, ns)
    workers = [*named, anonymous]
    assert all(ray.get([w.register.remote() for w in workers]))
    ray.get([w.send_snapshot.remote() for w in workers])
    ray.get(named[0].serve.remote([prompt(6, 1), prompt(3, 2)]))
    ray.get(named[1].serve.remote([prompt(4, 1), prompt(5, 3)]))
    ray.get(anonymous.serve.remote([prompt(2, 4)]))
    ray.get(coord.route.remote(RouteQuery(prompt(6, 1), 24, PAGE)))
    before = index_of(coord)
    assert before.match(prompt(6, 1)).pages == {"w0": 6, "w1": 4}
    assert get_or_create_coordinator(cfg)._actor_id == coord._actor_id  # get-if-exists

    pid = ray.get(coord.pid.remote())
    ray.kill(coord, no_restart=False)
    end = time.monotonic() + 90
    while True:  # ray.kill is asynchronous: wait for the new process
        try:
            if ray.get(coord.pid.remote(), timeout=30) != pid:
                break
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < end, "the coordinator was not restarted"
        time.sleep(0.2)
    wait_until_ready(coord)

    stats = ray.get(coord.stats.remote())
    assert stats["routes"] == 0  # a fresh coordinator, not the old one
    assert stats["workers"] == 3  # the registry survived in Ray's GCS
    after = index_of(coord)
    for wid, worker in (("w0", named[0]), ("w1", named[1])):
        truth = ray.get(worker.cached.remote())
        assert after.worker_pages(WorkerId(wid)) == before.worker_pages(WorkerId(wid)) == truth
        assert not after.is_stale(WorkerId(wid))
    for p in (prompt(6, 1), prompt(3, 2), prompt(5, 3)):
        assert after.match(p).pages == before.match(p).pages
    # The worker without an actor name is rebuilt lazily: its next report asks for a snapshot.
    assert after.worker_pages(WorkerId("anon")) == frozenset()
    assert ray.get(anonymous.serve.remote([prompt(2, 5)])) is True
    assert ray.get(anonymous.send_snapshot.remote()) is False
    assert index_of(coord).worker_pages(WorkerId("anon")) == ray.get(anonymous.cached.remote())
    d = ray.get(coord.route.remote(RouteQuery(prompt(5, 3), 20, PAGE)))
    assert (d.worker_id, d.local_pages) == ("w1", 5)
    for w in workers:
        ray.kill(w)
    ray.kill(coord, no_restart=True)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_route_waits_for_the_report_its_client_read_the_answer_of(
    ray_cluster: None, shards: int
) -> None:
    """A worker answers before its report reaches the coordinator; the client's next route
    names that report (`RouteQuery.after`) and is decided only once it is applied. The
    heartbeat interval is long, so the route cannot give up waiting within this test."""
    cfg, coord = ready_coordinator(
        heartbeat_interval_s=60.0, heartbeat_timeout_s=600.0, index_shards=shards
    )
    workers = [RemoteWorker.remote(f"w{i}", coord, None, cfg.namespace) for i in range(3)]
    ray.get([w.register.remote() for w in workers])
    ray.get([w.send_snapshot.remote() for w in workers])  # seq 0 each
    held = prompt(5, 11)
    incarnation = ray.get(workers[1].incarnation_of.remote())
    after = (ReportMark(WorkerId("w1"), incarnation, 1),)  # the report of seq 1: not sent yet
    pending = coord.route.remote(RouteQuery(held, 5 * PAGE + 1, PAGE, after=after))
    ready, _ = ray.wait([pending], timeout=1.0)
    assert not ready, "the route was decided before the report it follows"
    assert ray.get(workers[1].serve.remote([held])) is False  # seq 1
    d = ray.get(pending, timeout=60)
    assert (d.worker_id, d.local_pages) == ("w1", 5)
    # A mark of a report already applied, or of a worker gone, does not hold a route.
    d = ray.get(coord.route.remote(RouteQuery(held, 5 * PAGE + 1, PAGE, after=after)), timeout=30)
    assert d.worker_id == "w1"
    for w in workers:
        ray.kill(w)
    ray.kill(coord, no_restart=True)


def test_a_route_following_a_lost_report_waits_one_heartbeat_interval_at_most(
    ray_cluster: None,
) -> None:
    cfg, coord = ready_coordinator(heartbeat_interval_s=0.2, heartbeat_timeout_s=600.0)
    worker = RemoteWorker.remote("w0", coord, None, cfg.namespace)
    ray.get(worker.register.remote())
    ray.get(worker.serve.remote([prompt(3, 12)]))  # seq 0
    lost = (ReportMark(WorkerId("w0"), ray.get(worker.incarnation_of.remote()), 7),)
    d = ray.get(coord.route.remote(RouteQuery(prompt(3, 12), 13, PAGE, after=lost)), timeout=60)
    assert (d.worker_id, d.local_pages) == ("w0", 3)  # routed on what the index holds
    ray.kill(worker)
    ray.kill(coord, no_restart=True)


def test_a_worker_that_stops_heartbeating_is_dropped_by_the_background_loop(
    ray_cluster: None,
) -> None:
    cfg, coord = ready_coordinator(heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0)
    worker = RemoteWorker.remote("silent", coord, None, cfg.namespace)
    ray.get(worker.register.remote())
    ray.get(worker.serve.remote([prompt(3, 9)]))
    assert index_of(coord).match(prompt(3, 9)).pages == {"silent": 3}
    end = time.monotonic() + 30
    while ray.get(coord.stats.remote())["workers"] and time.monotonic() < end:
        time.sleep(0.2)
    stats = ray.get(coord.stats.remote())
    assert (stats["workers"], stats["workers_expired"], stats["indexed_pages"]) == (0, 1, 0)
    with pytest.raises(UnknownWorker):
        ray.get(worker.serve.remote([prompt(1, 9)]))
    ray.kill(worker)
    ray.kill(coord, no_restart=True)
