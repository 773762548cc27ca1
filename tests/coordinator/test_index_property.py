"""Property: the index equals the union of real page pools' cached sets.

Random request streams run through real `PagePool`s (hits, allocation with
eviction, caching, frees, explicit evictions, resets, worker restarts); their
events flow into the index as encoded batches, in order, or lost, duplicated
and shuffled on the way. After in-order delivery the index equals the pools at
every step; after a lossy delivery it does once every stale worker has sent a
snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.coordinator.index import GlobalIndex
from kvmesh.events import encode_batch, make_batch
from kvmesh.hashing import PageHasher
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.page_pool import PagePool

PAGE = 2
HASHER = PageHasher(PAGE, algo="xxh3_128")
WORKERS = 3
POOL_PAGES = 10

# Prompts share prefixes: family f, variant v share their first pages.
PROMPTS: list[list[PageHash]] = [
    HASHER.hash_prompt([f] * (2 * PAGE) + [f * 10 + v] * (k * PAGE))
    for f in range(3)
    for v in range(3)
    for k in (1, 3)
]

op = st.one_of(
    st.tuples(st.just("serve"), st.integers(0, WORKERS - 1), st.integers(0, len(PROMPTS) - 1)),
    st.tuples(st.just("serve"), st.integers(0, WORKERS - 1), st.integers(0, len(PROMPTS) - 1)),
    st.tuples(st.just("evict"), st.integers(0, WORKERS - 1), st.integers(0, len(PROMPTS) - 1)),
    st.tuples(st.just("reset"), st.integers(0, WORKERS - 1), st.just(0)),
    st.tuples(st.just("restart"), st.integers(0, WORKERS - 1), st.just(0)),
)
ops = st.lists(op, min_size=3, max_size=50)
fate = st.sampled_from(["deliver", "deliver", "drop", "twice", "delay"])
steps = st.lists(st.tuples(op, fate), min_size=3, max_size=50)


@dataclass
class Worker:
    worker_id: WorkerId
    pool: PagePool = field(default_factory=lambda: PagePool(POOL_PAGES, page_size=PAGE))
    incarnation: int = 0
    seq: int = 0

    def serve(self, hashes: list[PageHash]) -> None:
        hit = self.pool.match_prefix(hashes, len(hashes))
        self.pool.touch(hit)
        need = len(hashes) - len(hit)
        if need > self.pool.get_num_free_pages():
            self.pool.free_pages(list(reversed(hit)))
            return
        pages = hit + self.pool.get_new_pages(need)
        self.pool.cache_full_pages(pages, hashes, len(hit), len(hashes))
        self.pool.free_pages(list(reversed(pages)))

    def batch(self, snapshot: bool = False) -> bytes:
        events = self.pool.take_events()
        if snapshot:
            events = list(self.pool.snapshot_events())
        data = encode_batch(
            make_batch(
                events, self.worker_id, f"inc-{self.incarnation}", self.seq, snapshot=snapshot
            )
        )
        self.seq += 1
        return data

    def restart(self) -> None:
        self.pool = PagePool(POOL_PAGES, page_size=PAGE)
        self.incarnation += 1
        self.seq = 0


def run(workers: list[Worker], op: tuple[str, int, int]) -> bytes:
    """Apply one operation to a worker's pool; returns that worker's next batch."""
    kind, w, arg = op
    worker = workers[w]
    if kind == "serve":
        worker.serve(PROMPTS[arg])
    elif kind == "evict":
        worker.pool.evict_pages(PROMPTS[arg][-2:])
    elif kind == "reset":
        worker.pool.reset_prefix_cache()
    else:
        worker.restart()
    return worker.batch()


def matches_pools(index: GlobalIndex, workers: list[Worker]) -> None:
    index.check_invariants()
    known = set(index.workers())
    for w in workers:
        held = index.worker_pages(w.worker_id) if w.worker_id in known else frozenset()
        assert held == frozenset(w.pool.cached_hashes())
    union = set().union(*(w.pool.cached_hashes() for w in workers))
    assert index.all_pages() == union
    assert len(index) == len(union)
    for hashes in PROMPTS:
        got = index.match(hashes).pages
        want = {
            w.worker_id: n
            for w in workers
            if (n := len(w.pool.match_prefix(hashes, len(hashes)))) > 0
        }
        assert got == want


def fresh_cluster() -> tuple[GlobalIndex, list[Worker]]:
    return GlobalIndex(), [Worker(WorkerId(f"w{i}")) for i in range(WORKERS)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_in_order_delivery_keeps_the_index_equal_to_the_pools_at_every_step(
    stream: list[tuple[str, int, int]],
) -> None:
    index, workers = fresh_cluster()
    for o in stream:
        index.apply_encoded(run(workers, o))
        matches_pools(index, workers)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_lost_duplicated_and_shuffled_batches_are_repaired_by_snapshots(
    stream: list[tuple[tuple[str, int, int], str]],
) -> None:
    index, workers = fresh_cluster()
    delayed: list[bytes] = []
    for o, fate in stream:
        data = run(workers, o)
        if fate == "drop":
            continue
        if fate == "delay":
            delayed.append(data)
            continue
        index.apply_encoded(data)
        if fate == "twice":
            index.apply_encoded(data)
        while delayed:
            index.apply_encoded(delayed.pop())
        index.check_invariants()
    for data in delayed:
        index.apply_encoded(data)
    for w in workers:  # flush what is left, then resync whoever is stale
        if index.apply_encoded(w.batch()).needs_snapshot:
            index.apply_encoded(w.batch(snapshot=True))
    assert index.stale_workers() == set()
    matches_pools(index, workers)


@settings(max_examples=30, deadline=None)
@given(ops)
def test_snapshot_then_restore_gives_identical_matches(stream: list[tuple[str, int, int]]) -> None:
    index, workers = fresh_cluster()
    for o in stream:
        index.apply_encoded(run(workers, o))
    copy = GlobalIndex()
    copy.restore(index.snapshot())
    for hashes in PROMPTS:
        for n in range(len(hashes) + 1):
            assert copy.match(hashes[:n]) == index.match(hashes[:n])
    matches_pools(copy, workers)
