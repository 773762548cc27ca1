"""The coordinator service with real page pools on the worker side (no Ray)."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import pytest

from kvmesh.config import CoordinatorConfig
from kvmesh.coordination import RouteQuery, WorkerReport
from kvmesh.coordinator.index import ApplyResult
from kvmesh.coordinator.policies import WorkerLoad
from kvmesh.coordinator.service import Coordinator
from kvmesh.coordinator.shards import ShardedCoordinator
from kvmesh.errors import ConfigError, EventDecodeError, InvalidInput, NoWorkers, UnknownWorker
from kvmesh.hashing import PageHasher
from kvmesh.requests import RouteOutcome
from kvmesh.types import PageHash, WorkerId
from tests.coordinator.pool_worker_kit import PoolWorker

PAGE = 4
HASHER = PageHasher(PAGE)


def prompt(n_pages: int, tag: int) -> list[PageHash]:
    return HASHER.hash_prompt([tag * 1000 + i for i in range(n_pages * PAGE)])


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def cluster(n: int = 3, **cfg: object) -> tuple[Coordinator, list[PoolWorker], Clock]:
    clock = Clock()
    coord = Coordinator(CoordinatorConfig(**cfg), clock=clock, rng=random.Random(0))  # type: ignore[arg-type]
    workers = [PoolWorker(f"w{i}") for i in range(n)]
    for w in workers:
        assert w.register(coord)
        coord.report(WorkerReport(w.worker_id, [w.snapshot()]))
    return coord, workers, clock


def index_equals_pools(coord: Coordinator, workers: Sequence[PoolWorker]) -> bool:
    return all(
        coord.index.worker_pages(w.worker_id) == frozenset(w.pool.cached_hashes()) for w in workers
    )


def test_a_request_goes_to_the_worker_whose_pool_holds_its_prefix() -> None:
    coord, (_w0, w1, _), _ = cluster()
    p = prompt(6, tag=1)
    w1.serve(p)
    coord.report(WorkerReport(w1.worker_id, [w1.batch()]))
    d = coord.route(RouteQuery(p, 6 * PAGE + 1, page_size=PAGE))
    assert (d.worker_id, d.local_pages) == (w1.worker_id, 6)
    assert w1.serve(p) == d.local_pages  # the promise holds on the real pool


def test_the_decision_names_the_peer_when_the_chosen_worker_holds_less() -> None:
    coord, (w0, _w1, _), _ = cluster()
    p = prompt(8, tag=2)
    w0.serve(p)
    coord.report(WorkerReport(w0.worker_id, [w0.batch()], WorkerLoad(w0.worker_id, 100 * PAGE)))
    d = coord.route(RouteQuery(p, 8 * PAGE, page_size=PAGE, allow_pull=True))
    assert d.worker_id != w0.worker_id  # w0's prefill queue is far longer
    assert (d.peer_id, d.peer_pages) == (w0.worker_id, 8)


def test_a_report_from_an_unregistered_worker_says_register_again() -> None:
    coord, _, _ = cluster(1)
    stranger = PoolWorker("stranger")
    with pytest.raises(UnknownWorker):
        coord.report(WorkerReport(stranger.worker_id, [stranger.batch()]))


def test_one_bad_batch_rejects_the_whole_report_and_changes_nothing() -> None:
    coord, (w0, *_), _ = cluster()
    w0.serve(prompt(3, tag=3))
    good = w0.batch()
    before = coord.snapshot_index()
    with pytest.raises(EventDecodeError):
        coord.report(WorkerReport(w0.worker_id, [good, b"\x93garbage"]))
    with pytest.raises(EventDecodeError, match="reported a batch of"):
        coord.report(WorkerReport(WorkerId("w1"), [good]))
    assert coord.snapshot_index() == before
    assert coord.stats().batches_rejected == 3
    assert coord.report(WorkerReport(w0.worker_id, [good])).results == (ApplyResult.APPLIED,)


def test_a_gap_asks_for_a_snapshot_which_brings_the_index_back_in_line() -> None:
    coord, (w0, *_), _ = cluster()
    w0.serve(prompt(3, tag=4))
    w0.batch()  # lost on the way
    w0.serve(prompt(2, tag=5))
    reply = coord.report(WorkerReport(w0.worker_id, [w0.batch()]))
    assert reply.needs_snapshot and reply.results == (ApplyResult.STALE,)
    assert coord.route(RouteQuery(prompt(3, tag=4), 12, page_size=PAGE)).local_pages == 0
    reply = coord.report(WorkerReport(w0.worker_id, [w0.snapshot()]))
    assert not reply.needs_snapshot
    assert index_equals_pools(coord, [w0])


def test_batches_of_an_old_incarnation_are_ignored_after_re_registration() -> None:
    coord, (w0, *_), _ = cluster()
    w0.serve(prompt(3, tag=6))
    old_batch = w0.batch()
    reborn = PoolWorker("w0", incarnation="inc-2")
    reborn.register(coord)
    assert coord.report(WorkerReport(w0.worker_id, [old_batch])).results == (ApplyResult.IGNORED,)
    assert coord.index.worker_pages(w0.worker_id) == frozenset()


def test_a_silent_worker_expires_with_its_pages() -> None:
    coord, (w0, w1, w2), clock = cluster(heartbeat_timeout_s=5.0)
    w2.serve(prompt(4, tag=7))
    coord.report(WorkerReport(w2.worker_id, [w2.batch()]))
    clock.t = 4.0
    coord.heartbeat(w0.worker_id)
    coord.heartbeat(w1.worker_id)
    clock.t = 6.0
    assert coord.expire() == [w2.worker_id]
    assert coord.match(prompt(4, tag=7)).pages == {}
    assert coord.stats().workers_expired == 1
    with pytest.raises(UnknownWorker):
        coord.heartbeat(w2.worker_id)


def test_a_draining_worker_gets_requests_only_when_nothing_else_is_left() -> None:
    coord, (w0, w1), _ = cluster(2)
    p = prompt(4, tag=8)
    w0.serve(p)
    coord.report(WorkerReport(w0.worker_id, [w0.batch()]))
    coord.drain_worker(w0.worker_id)
    assert coord.route(RouteQuery(p, 16, page_size=PAGE)).worker_id == w1.worker_id
    coord.remove_worker(w1.worker_id)
    d = coord.route(RouteQuery(p, 16, page_size=PAGE))
    assert (d.worker_id, d.degraded) == (w0.worker_id, True)


def test_removing_every_worker_leaves_nothing_to_route_to() -> None:
    coord, workers, _ = cluster(2)
    for w in workers:
        assert coord.remove_worker(w.worker_id)
    assert not coord.remove_worker(WorkerId("w0"))
    with pytest.raises(NoWorkers):
        coord.route(RouteQuery(prompt(2, tag=9), 8, page_size=PAGE))


def test_route_can_ask_for_another_policy_by_name() -> None:
    coord, _, _ = cluster(3)
    picks = [
        coord.route(RouteQuery(prompt(2, 10), 8, page_size=PAGE, policy="round_robin"))
        for _ in range(3)
    ]
    assert [d.worker_id for d in picks] == ["w0", "w1", "w2"]
    assert {d.policy for d in picks} == {"round_robin"}
    with pytest.raises(ConfigError, match="unknown routing policy"):
        coord.route(RouteQuery(prompt(2, 10), 8, page_size=PAGE, policy="nope"))


def test_routes_can_be_restricted_to_a_role() -> None:
    coord = Coordinator(rng=random.Random(0))
    PoolWorker("p").register(coord, role="prefill")
    PoolWorker("d").register(coord, role="decode")
    assert {coord.route(RouteQuery([], 4, role="decode")).worker_id for _ in range(5)} == {"d"}
    assert {coord.route(RouteQuery([], 4, role="prefill")).worker_id for _ in range(5)} == {"p"}


def test_rebuild_from_snapshots_equals_the_pools_and_isolates_a_bad_one() -> None:
    _coord, workers, _ = cluster()
    rng = random.Random(1)
    for _ in range(30):
        rng.choice(workers).serve(prompt(rng.randint(1, 6), tag=rng.randint(0, 8)))
    fresh = Coordinator(rng=random.Random(0))
    for w in workers:
        w.register(fresh)
    result = fresh.request_snapshots({w.worker_id: w for w in workers[:2]})
    assert set(result.applied) == {"w0", "w1"} and not result.failed
    bad = fresh.rebuild_from_snapshots({workers[2].worker_id: workers[2].batch()})
    assert "expected a snapshot batch" in bad.failed["w2"]
    assert fresh.rebuild_from_snapshots({workers[2].worker_id: workers[2].snapshot()}).applied
    assert index_equals_pools(fresh, workers)
    fresh.index.check_invariants()


def test_predicted_and_realized_pages_are_counted_and_mismatches_show_up() -> None:
    coord, (_w0, *_), _ = cluster(1)
    assert not coord.record_result(4, 0, 4, 0)
    assert coord.record_result(4, 2, 0, 0)  # e.g. router and worker hash differently
    s = coord.stats()
    assert (s.results_recorded, s.mismatches, s.realized_local_pages) == (2, 1, 4)
    with pytest.raises(InvalidInput):
        coord.record_result(-1, 0, 0, 0)


def test_outcomes_ride_with_a_report_and_are_counted_like_record_result() -> None:
    coord, (w0, *_), _ = cluster(1)
    w0.serve(prompt(2, tag=30))
    kept, missed = RouteOutcome(2, 0, 2, 0), RouteOutcome(3, 1, 0, 0)
    coord.report(WorkerReport(w0.worker_id, [w0.batch()], None, [kept, missed]))
    s = coord.stats()
    assert (s.results_recorded, s.mismatches, s.realized_local_pages) == (2, 1, 2)
    assert coord.index.worker_pages(w0.worker_id) == frozenset(w0.pool.cached_hashes())


def test_a_sharded_coordinator_counts_the_outcomes_a_report_carries() -> None:
    coord = ShardedCoordinator(CoordinatorConfig(index_shards=2), clock=lambda: 0.0)
    w0 = PoolWorker("w0")
    w0.register(coord)  # type: ignore[arg-type]
    coord.report(WorkerReport(w0.worker_id, [w0.snapshot()], None, [RouteOutcome(2, 0, 0, 0)]))
    stats = coord.stats()
    assert (stats["results_recorded"], stats["mismatches"]) == (1, 1)


def test_a_bad_outcome_refuses_the_whole_report_and_changes_nothing() -> None:
    coord, (w0, *_), _ = cluster(1)
    w0.serve(prompt(2, tag=31))
    with pytest.raises(InvalidInput, match="realized_pull"):
        coord.report(WorkerReport(w0.worker_id, [w0.batch()], None, [RouteOutcome(1, 0, 1, -2)]))
    assert coord.stats().results_recorded == 0
    assert coord.index.worker_pages(w0.worker_id) == frozenset()


def test_a_routed_request_weighs_on_its_worker_until_the_worker_reports() -> None:
    coord, _, _ = cluster(2)
    p = prompt(3, tag=32)
    coord.route(RouteQuery(p, 3 * PAGE + 2))  # a look: nothing is sent
    assert all(
        load.active_prefill_tokens == 0 for load in coord.view(RouteQuery(p, 3 * PAGE + 2)).loads
    )
    decision = coord.route(RouteQuery(p, 3 * PAGE + 2, request_id="r1"))
    loads = {load.worker_id: load for load in coord.view(RouteQuery(p, 3 * PAGE + 2)).loads}
    routed = loads[decision.worker_id]
    assert (routed.active_prefill_tokens, routed.active_requests) == (3 * PAGE + 2, 1)
    assert sum(load.active_requests for load in loads.values()) == 1
    coord.report(
        WorkerReport(decision.worker_id, [], WorkerLoad(decision.worker_id))
    )  # measured: idle
    assert all(
        load.active_prefill_tokens == 0 for load in coord.view(RouteQuery(p, 3 * PAGE + 2)).loads
    )


def test_stats_count_routes_batches_and_pages() -> None:
    coord, (w0, _w1, _w2), _ = cluster()
    w0.serve(prompt(5, tag=11))
    coord.report(WorkerReport(w0.worker_id, [w0.batch()]))
    coord.route(RouteQuery(prompt(5, tag=11), 20, page_size=PAGE))
    s = coord.stats()
    assert (s.workers, s.indexed_pages, s.index_entries, s.routes) == (3, 5, 5, 1)
    assert s.routes_by_worker == {"w0": 1}
    assert s.promised_local_pages == 5
    assert (s.batches_replaced, s.batches_applied) == (3, 1)
    assert s.as_dict()["routes"] == 1


def test_restore_index_keeps_only_registered_workers() -> None:
    coord, (_w0, w1, _w2), _ = cluster()
    w1.serve(prompt(3, tag=12))
    coord.report(WorkerReport(w1.worker_id, [w1.batch()]))
    data = coord.snapshot_index()
    other = Coordinator()
    w1.register(other)
    other.restore_index(data)
    assert other.index.workers() == ["w1"]
    assert other.match(prompt(3, tag=12)).pages == {"w1": 3}


def test_concurrent_reports_and_routes_keep_the_index_consistent() -> None:
    coord, workers, _ = cluster(4)
    locks = {w.worker_id: threading.Lock() for w in workers}
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                w = rng.choice(workers)
                with locks[w.worker_id]:  # one worker's batches go out in seq order
                    w.serve(prompt(rng.randint(1, 5), tag=rng.randint(0, 6)))
                    coord.report(WorkerReport(w.worker_id, [w.batch()]))
                coord.route(RouteQuery(prompt(4, tag=rng.randint(0, 6)), 16, page_size=PAGE))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    coord.index.check_invariants()
    assert index_equals_pools(coord, workers)
    assert coord.stats().routes == 240


def test_a_stale_worker_is_not_routed_to_for_its_prefix_until_it_resyncs() -> None:
    coord, (w0, w1), _ = cluster(2)
    p = prompt(6, tag=13)
    w0.serve(p)
    coord.report(WorkerReport(w0.worker_id, [w0.batch()]))
    w0.batch()  # lost: the next report reveals the gap
    coord.report(WorkerReport(w0.worker_id, [w0.batch()]))
    d = coord.route(RouteQuery(p, 24, page_size=PAGE))
    assert (d.worker_id, d.local_pages, d.peer_id) == (w1.worker_id, 0, None)
    coord.report(WorkerReport(w0.worker_id, [w0.snapshot()]))
    assert coord.route(RouteQuery(p, 24, page_size=PAGE)).worker_id == w0.worker_id


def test_every_change_of_the_loads_takes_a_new_loads_version() -> None:
    coord, (w0, w1, _), _ = cluster(3)
    p = prompt(3, tag=33)
    look = RouteQuery(p, 3 * PAGE + 2)
    seen = [coord.loads_version]
    coord.report(WorkerReport(w0.worker_id, [], WorkerLoad(w0.worker_id, 7)))
    seen.append(coord.loads_version)
    coord.route(RouteQuery(p, 3 * PAGE + 2, request_id="r1"))  # counted in its worker's load
    seen.append(coord.loads_version)
    coord.drain_worker(w1.worker_id)
    seen.append(coord.loads_version)
    coord.remove_worker(w1.worker_id)
    seen.append(coord.loads_version)
    assert len(set(seen)) == len(seen)
    coord.route(look)  # a look changes nothing
    coord.view(look)
    assert coord.loads_version == seen[-1]
    # one loads tuple per version: a router can tell by identity that nothing changed
    assert coord.view(look).loads is coord.view(look).loads
    assert Coordinator(CoordinatorConfig()).loads_version != coord.loads_version


def test_a_coordinator_leaves_out_the_loads_its_caller_holds_and_only_those() -> None:
    coord, (w0, *_), _ = cluster(3)
    look = RouteQuery(prompt(2, tag=34), 2 * PAGE)
    full = coord.view(look)
    assert len(full.loads) == 3
    held = coord.view(look, full.loads_version)
    assert held.loads == () and held.loads_version == full.loads_version
    assert held.overlaps == full.overlaps
    assert coord.view_many([look, look], full.loads_version) == [held, held]
    coord.report(WorkerReport(w0.worker_id, [], WorkerLoad(w0.worker_id, 9)))
    changed = coord.view(look, full.loads_version)  # they changed: sent again
    assert changed.loads_version != full.loads_version
    assert {x.worker_id: x.active_prefill_tokens for x in changed.loads}[w0.worker_id] == 9
