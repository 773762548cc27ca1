"""Event delivery faults at the coordinator: lost, repeated and shuffled batches, snapshot/restore.

Workers here are real `PagePool`s serving prompts that share prefixes (hits,
allocation with eviction, caching, frees), numbering their encoded batches
from 0 like `WorkerActor` does; the coordinator is the real `Coordinator`
service (registry + index + policy), fed through `report` as a worker's
heartbeat would feed it. The index-level properties (every step of random
streams, lost / doubled / delayed batches healed by snapshots) are in
``tests/coordinator/test_index_property.py``; these tests add what the
issue asks of the cluster: one worker's loss resyncs only that worker, a
shuffled or doubled stream needs no resync at all, and a snapshot restores
to identical matches on 10,000 random prefixes.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.config import CoordinatorConfig
from kvmesh.coordination import WorkerRegistration, WorkerReport
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.service import Coordinator
from kvmesh.events import encode_batch, make_batch
from kvmesh.hashing import PageHasher
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.page_pool import PagePool
from tests.coordinator.pool_worker_kit import serve_request

PAGE = 4
HASHER = PageHasher(PAGE, algo="xxh3_128")
POOL_PAGES = 40
WORKERS = [WorkerId(f"w{i}") for i in range(3)]


def prompt_family(rng: random.Random, families: int, depth: int) -> list[list[PageHash]]:
    """Prompts that share prefixes: family f's prompts start with the same 2 pages."""
    out = []
    for f in range(families):
        head = [f * 7 + 1] * (2 * PAGE)
        for _ in range(depth):
            tail = [rng.randrange(256) for _ in range(rng.randrange(1, 6) * PAGE)]
            out.append(HASHER.hash_prompt(head + tail))
    return out


PROMPTS = prompt_family(random.Random(3), families=4, depth=6)


@dataclass
class PoolWorker:
    """A worker's pool and its event stream, numbered as `WorkerActor` numbers it."""

    worker_id: WorkerId
    pool: PagePool = field(default_factory=lambda: PagePool(POOL_PAGES, page_size=PAGE))
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    seq: int = 0
    snapshots: int = 0

    def serve(self, hashes: list[PageHash]) -> None:
        serve_request(self.pool, hashes)

    def batch(self, snapshot: bool = False) -> bytes:
        events = list(self.pool.snapshot_events()) if snapshot else []
        drained = self.pool.take_events()
        data = encode_batch(
            make_batch(
                events if snapshot else drained,
                self.worker_id,
                self.incarnation,
                self.seq,
                snapshot=snapshot,
            )
        )
        self.seq += 1
        self.snapshots += snapshot
        return data

    def truth(self) -> frozenset[PageHash]:
        return frozenset(self.pool.cached_hashes())


def cluster(reorder_window: int = 64) -> tuple[Coordinator, list[PoolWorker]]:
    coord = Coordinator(CoordinatorConfig(reorder_window=reorder_window))
    workers = [PoolWorker(w) for w in WORKERS]
    for w in workers:
        coord.register_worker(
            WorkerRegistration(w.worker_id, "127.0.0.1:0", POOL_PAGES - 1, w.incarnation)
        )
        coord.report(WorkerReport(w.worker_id, [w.batch(snapshot=True)]))
    return coord, workers


def assert_index_equals_pools(coord: Coordinator, workers: list[PoolWorker]) -> None:
    index = coord.index
    index.check_invariants()
    assert index.stale_workers() == set()
    for w in workers:
        assert index.worker_pages(w.worker_id) == w.truth()
    for hashes in PROMPTS:
        want = {
            w.worker_id: n
            for w in workers
            if (n := len(w.pool.match_prefix(hashes, len(hashes)))) > 0
        }
        assert coord.match(hashes).pages == want


def play(rng: random.Random, workers: list[PoolWorker], rounds: int) -> list[list[bytes]]:
    """Each round every worker serves a prompt; returns each round's batch per worker."""
    out = []
    for _ in range(rounds):
        out.append([])
        for w in workers:
            w.serve(PROMPTS[rng.randrange(len(PROMPTS))])
            out[-1].append(w.batch())
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    victim=st.integers(0, len(WORKERS) - 1),
    dropped=st.integers(0, 11),
)
def test_a_dropped_batch_resyncs_only_the_worker_it_belonged_to(
    seed: int, victim: int, dropped: int
) -> None:
    coord, workers = cluster()
    rng = random.Random(seed)
    rounds = play(rng, workers, 12)
    needs: dict[WorkerId, bool] = {w: False for w in WORKERS}
    for n, batches in enumerate(rounds):
        for i, (w, data) in enumerate(zip(workers, batches, strict=True)):
            if i == victim and n == dropped:
                continue  # lost on the way
            reply = coord.report(WorkerReport(w.worker_id, [data]))
            needs[w.worker_id] |= reply.needs_snapshot
            if needs[w.worker_id]:  # the worker answers a stale reply with a snapshot
                assert i == victim and n > dropped
                assert coord.index.stale_workers() == {w.worker_id}
                coord.report(WorkerReport(w.worker_id, [w.batch(snapshot=True)]))
                needs[w.worker_id] = False
    last = workers[victim]
    if dropped == len(rounds) - 1:  # the loss was the last batch: the next report finds the gap
        reply = coord.report(WorkerReport(last.worker_id, [last.batch()]))
        assert reply.needs_snapshot
        coord.report(WorkerReport(last.worker_id, [last.batch(snapshot=True)]))
    assert [w.snapshots for w in workers] == [2 if i == victim else 1 for i in range(3)]
    assert_index_equals_pools(coord, workers)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), doubled=st.floats(0.0, 0.5))
def test_batches_delivered_twice_or_shuffled_end_equal_to_the_pools_without_a_resync(
    seed: int, doubled: float
) -> None:
    coord, workers = cluster()
    rng = random.Random(seed)
    rounds = play(rng, workers, 15)
    stream = [(w, data) for batches in rounds for w, data in zip(workers, batches, strict=True)]
    stream += [item for item in stream if rng.random() < doubled]
    rng.shuffle(stream)
    for w, data in stream:
        coord.report(WorkerReport(w.worker_id, [data]))
    assert [w.snapshots for w in workers] == [1, 1, 1]  # only the registration snapshot
    assert_index_equals_pools(coord, workers)
    stats = coord.stats()
    assert stats.batches_ignored >= len(stream) - 15 * len(workers)  # every duplicate dropped


def test_a_late_batch_from_before_a_restart_changes_nothing() -> None:
    coord, workers = cluster()
    rng = random.Random(5)
    old = play(rng, workers, 3)
    for batches in old:
        for w, data in zip(workers, batches, strict=True):
            coord.report(WorkerReport(w.worker_id, [data]))
    w0 = workers[0]
    late = w0.batch()  # events of the old life, delivered after the restart
    w0.pool = PagePool(POOL_PAGES, page_size=PAGE)
    w0.incarnation, w0.seq = uuid.uuid4().hex, 0
    coord.register_worker(
        WorkerRegistration(w0.worker_id, "127.0.0.1:0", POOL_PAGES - 1, w0.incarnation)
    )
    coord.report(WorkerReport(w0.worker_id, [w0.batch(snapshot=True)]))
    w0.serve(PROMPTS[0])
    coord.report(WorkerReport(w0.worker_id, [w0.batch()]))
    coord.report(WorkerReport(w0.worker_id, [late]))
    assert_index_equals_pools(coord, workers)


def test_snapshot_then_restore_gives_identical_matches_on_10000_random_prefixes() -> None:
    coord, workers = cluster()
    rng = random.Random(20261124)
    for batches in play(rng, workers, 40):
        for w, data in zip(workers, batches, strict=True):
            coord.report(WorkerReport(w.worker_id, [data]))
    assert_index_equals_pools(coord, workers)
    data = coord.snapshot_index()
    copy = GlobalIndex()
    copy.restore(data)
    copy.check_invariants()
    restored = Coordinator(CoordinatorConfig())
    for w in workers:
        restored.register_worker(
            WorkerRegistration(w.worker_id, "127.0.0.1:0", POOL_PAGES - 1, w.incarnation)
        )
    restored.restore_index(data)
    assert copy.snapshot() == data  # a second round trip is byte-identical
    foreign = HASHER.hash_prompt([255] * (8 * PAGE))
    hits = 0
    for _ in range(10_000):
        hashes = PROMPTS[rng.randrange(len(PROMPTS))]
        prefix = hashes[: rng.randrange(len(hashes) + 1)]
        if rng.random() < 0.2:  # prefixes that leave the cached tree
            prefix = prefix + foreign[: rng.randrange(1, 4)]
        want = coord.match(prefix)
        assert copy.match(prefix) == want
        assert restored.match(prefix) == want
        hits += bool(want.pages)
    assert hits > 5_000  # the prefixes mostly hit: the comparison is not of empty matches
    for w in workers:
        assert copy.worker_pages(w.worker_id) == w.truth()
