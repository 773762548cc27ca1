"""Property: the columnar index answers exactly as a plain-dict reference model.

`DictStore` keeps what the index held before it became columnar: one dict
hash -> holder mask, one dict hash -> parent, one set of hashes per worker
slot. It plugs into the same `GlobalIndex` sequencing (incarnations, gaps,
snapshots), so the comparison pins the storage: random event streams with
removals, clears, gaps (stale workers), duplicates, snapshot batches, new
incarnations and removed workers, over page hashes that mix vLLM-style 8-byte
engine hashes, 32-byte digests, odd lengths, and digests built to share their
first 8 bytes (compact-key clashes). After every batch both give the same
apply result; at checkpoints the same `match` for every prefix, the same
snapshot bytes, pages, holders, parents and chains.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.index_store import PageStore
from kvmesh.errors import InvariantViolation
from kvmesh.events import AllPagesCleared, EventBatch, KVEvent, PagesRemoved, PagesStored
from kvmesh.types import PageHash, WorkerId

_WORKER_BITS = 0b1111


class DictStore:
    """The reference: plain dicts and sets, one Python step per page."""

    def __init__(self) -> None:
        self.holders: dict[PageHash, int] = {}
        self.parents: dict[PageHash, PageHash | None] = {}
        self.slots: dict[int, set[PageHash]] = {}
        self.masks: list[int] = [0]

    def ensure_slot(self, slot: int) -> None:
        self.slots.setdefault(slot, set())

    def store(
        self, events: Sequence[tuple[Sequence[PageHash], PageHash | None]], slot: int, bit: int
    ) -> None:
        for hs, parent in events:
            if not hs:
                continue
            for h, p in zip(hs, (parent, *hs[:-1]), strict=True):
                self.holders[h] = self.holders.get(h, 0) | bit
                self.parents[h] = p
                self.slots[slot].add(h)

    def remove(self, hashes: Sequence[PageHash], slot: int, clear: int) -> None:
        mine = _WORKER_BITS << (slot * 4)
        for h in hashes:
            m = self.holders.get(h)
            if m is None or not m & clear:
                continue
            m &= ~clear
            if m:
                self.holders[h] = m
            else:
                del self.holders[h]
                del self.parents[h]
            if not m & mine:
                self.slots[slot].discard(h)

    def drop_slot(self, slot: int) -> int:
        pages = list(self.slots.get(slot, ()))
        self.remove(pages, slot, _WORKER_BITS << (slot * 4))
        return len(pages)

    def walk(self, keys: object) -> None:
        return None  # no compiled walk: `GlobalIndex` takes the general path

    def holder_ids(self, hashes: Sequence[PageHash]) -> list[int]:
        ids = []
        for h in hashes:
            self.masks.append(self.holders.get(h, 0))
            ids.append(len(self.masks) - 1 if self.masks[-1] else 0)
        return ids

    def mask(self, page_hash: PageHash) -> int:
        return self.holders.get(page_hash, 0)

    def parent(self, page_hash: PageHash) -> PageHash | None:
        return self.parents[page_hash]

    def __len__(self) -> int:
        return len(self.holders)

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self.holders

    def pages(self) -> list[PageHash]:
        return list(self.holders)

    def slot_pages(self, slot: int) -> list[PageHash]:
        return list(self.slots.get(slot, ()))

    def slot_count(self, slot: int) -> int:
        return len(self.slots.get(slot, ()))

    def num_entries(self) -> int:
        return sum(map(len, self.slots.values()))

    def items(self) -> list[tuple[PageHash, PageHash | None, int]]:
        return sorted((h, self.parents[h], m) for h, m in self.holders.items())

    def load(
        self,
        hashes: Sequence[PageHash],
        parents: Sequence[PageHash | None],
        masks: Sequence[int],
        slots: Sequence[int],
    ) -> None:
        for h, p, m in zip(hashes, parents, masks, strict=True):
            self.holders[h], self.parents[h] = m, p
            for slot in slots:
                if m >> (slot * 4) & _WORKER_BITS:
                    self.slots[slot].add(h)

    def extra_bytes(self) -> int:
        return 0

    def check_invariants(self, live_slots: Sequence[int]) -> None:
        for slot, pages in self.slots.items():
            if slot in live_slots and pages != {
                h for h, m in self.holders.items() if m >> (slot * 4) & _WORKER_BITS
            }:
                raise InvariantViolation(f"reference slot {slot} disagrees with its masks")


def reference_index() -> GlobalIndex:
    index = GlobalIndex(reorder_window=3)
    index._store = DictStore()  # type: ignore[assignment]
    return index


def _digest(tag: str, i: int, size: int) -> PageHash:
    return PageHash(hashlib.sha256(f"{tag}/{i}".encode()).digest()[:size])


# Four chains of 6 pages: engine 8-byte hashes, SHA-256 digests, 16-byte xxh3-sized
# digests, and 32-byte digests whose first 8 bytes are those of the engine chain
# (every page clashes on its compact key with a page of chain 0). Plus odd sizes.
CHAINS: list[list[PageHash]] = [
    [_digest("engine", i, 8) for i in range(6)],
    [_digest("sha", i, 32) for i in range(6)],
    [_digest("xxh", i, 16) for i in range(6)],
    [PageHash(_digest("engine", i, 8) + _digest("tail", i, 24)) for i in range(6)],
    [PageHash(_digest("sha", i, 8) + b"\x00" * 8) for i in range(3)]  # clashes with chain 1
    + [_digest("odd", i, size) for i, size in enumerate((1, 5, 64))],
]
UNIVERSE = sorted({h for c in CHAINS for h in c})
WORKERS = [WorkerId(f"w{i}") for i in range(3)]
MEDIA = [None, "gpu", "cpu", "disk", "nvme-x"]

pages = st.lists(st.sampled_from(UNIVERSE), min_size=0, max_size=5)
stored = st.builds(
    lambda c, start, n, medium, parent, odd: PagesStored(
        tuple(CHAINS[c][start : start + n]),
        odd if odd is not None else (CHAINS[c][start - 1] if start else parent),
        (),
        16,
        None,
        medium,
    ),
    st.integers(0, len(CHAINS) - 1),
    st.integers(0, 5),
    st.integers(0, 6),
    st.sampled_from(MEDIA),
    st.one_of(st.none(), st.sampled_from(UNIVERSE)),
    st.one_of(st.none(), st.none(), st.none(), st.sampled_from(UNIVERSE)),
)
removed = st.builds(lambda hs, m: PagesRemoved(tuple(hs), m), pages, st.sampled_from(MEDIA))
event = st.one_of(stored, stored, stored, removed, removed, st.just(AllPagesCleared()))
# What happens to a worker's next batch on its way, or to the worker.
fate = st.sampled_from(
    ["in_order"] * 6 + ["gap", "duplicate", "snapshot", "restart", "remove_worker", "mark_stale"]
)
step = st.tuples(st.integers(0, len(WORKERS) - 1), fate, st.lists(event, max_size=4))


def same_answers(new: GlobalIndex, ref: GlobalIndex, restored: bool = False) -> None:
    """Same answers to every read; a restored index has no held-back batches (by design)."""
    new.check_invariants()
    assert new.snapshot() == ref.snapshot()
    assert new.all_pages() == ref.all_pages()
    assert len(new) == len(ref)
    assert new.num_entries() == ref.num_entries()
    assert new.workers() == ref.workers()
    for wid in ref.workers():
        assert new.worker_pages(wid) == ref.worker_pages(wid)
        state, want = new.worker_state(wid), ref.worker_state(wid)
        if restored:
            want = replace(want, pending_batches=0)
        assert state == want
    for h in UNIVERSE:
        assert (h in new) == (h in ref)
        assert new.holders(h) == ref.holders(h)
        if h in ref:
            assert new.parent(h) == ref.parent(h)
            assert new.chain(h) == ref.chain(h)
    for c in CHAINS:
        for n in range(len(c) + 1):
            assert new.match(c[:n]) == ref.match(c[:n])
    mixed = [CHAINS[0][0], CHAINS[3][1], CHAINS[1][0], CHAINS[4][0]]
    assert new.match(mixed) == ref.match(mixed)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, min_size=1, max_size=40))
def test_random_event_streams_give_the_reference_models_answers(
    steps: list[tuple[int, str, list[KVEvent]]],
) -> None:
    new, ref = GlobalIndex(reorder_window=3), reference_index()
    seq = [0] * len(WORKERS)
    life = [0] * len(WORKERS)
    ts = 1.0
    for i, (w, what, events) in enumerate(steps):
        wid = WORKERS[w]
        ts += 1.0
        if what == "remove_worker":
            assert new.remove_worker(wid) == ref.remove_worker(wid)
            continue
        if what == "mark_stale":
            if wid in ref.workers():
                new.mark_stale(wid)
                ref.mark_stale(wid)
            continue
        if what == "restart":
            life[w] += 1
            seq[w] = 0
        if what == "gap":
            seq[w] += 1
        if what == "duplicate" and seq[w]:
            seq[w] -= 1
        snap = what == "snapshot"
        batch = EventBatch(tuple(events), wid, f"life-{life[w]}", seq[w], ts, snap)
        seq[w] += 1
        assert new.apply(batch) is ref.apply(batch)
        if i % 8 == 7:
            same_answers(new, ref)
    same_answers(new, ref)
    copy = GlobalIndex(reorder_window=3)
    copy.restore(ref.snapshot())
    same_answers(copy, ref, restored=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(event, max_size=6)), max_size=30))
def test_many_pages_and_merges_keep_the_reference_answers(
    batches: list[tuple[int, list[KVEvent]]],
) -> None:
    """Thousands of pages per worker, so the lookup table grows and rows are reused."""
    new, ref = GlobalIndex(), reference_index()
    seq = [0, 0, 0]
    big = [_digest("big", i, 32 if i % 3 else 8) for i in range(6000)]
    for k, (w, events) in enumerate(batches):
        lo = (k * 997) % 5000
        bulk: list[KVEvent] = [
            PagesStored(tuple(big[lo : lo + 1000]), None, (), 16, None, "gpu"),
            PagesRemoved(tuple(big[lo + 500 : lo + 700]), None),
        ]
        batch = EventBatch(tuple(bulk + events), WORKERS[w], "life", seq[w], 1.0)
        seq[w] += 1
        assert new.apply(batch) is ref.apply(batch)
    same_answers(new, ref)
    for h in big[::97]:
        assert new.holders(h) == ref.holders(h)
        if h in ref:
            assert new.parent(h) == ref.parent(h)
    assert new.match(big[:40]) == ref.match(big[:40])


# One hash width (the prompt fast path): SHA-256 chains, the all-zero digest (a
# freed row is zeroed) and a digest whose compact key is 0; a lookup table that
# starts tiny, so it grows and is rebuilt every few keys. `GlobalIndex` answers these by
# the compiled walk (`PageStore.walk`); the reference, by the general path.
WIDE: list[list[PageHash]] = [[_digest(f"wide{c}", i, 32) for i in range(12)] for c in range(3)]
WIDE[2][3] = PageHash(bytes(32))
WIDE[1][0] = PageHash(bytes(8) + _digest("zero-key", 0, 24))
wide_stored = st.builds(
    lambda c, start, n: PagesStored(
        tuple(WIDE[c][start : start + n]), WIDE[c][start - 1] if start else None, (), 16
    ),
    st.integers(0, 2),
    st.integers(0, 11),
    st.integers(1, 12),
)
wide_removed = st.builds(
    lambda hs: PagesRemoved(tuple(hs)), st.lists(st.sampled_from([h for c in WIDE for h in c]))
)
wide_event = st.one_of(wide_stored, wide_stored, wide_removed, st.just(AllPagesCleared()))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 2), st.lists(wide_event, max_size=4)), max_size=30),
    st.integers(1, 40),
)
def test_prompts_of_one_hash_width_give_the_reference_answers(
    batches: list[tuple[int, list[KVEvent]]], min_slots: int
) -> None:
    new, ref = GlobalIndex(), reference_index()
    new._store = PageStore(min_slots=min_slots)
    seq = [0, 0, 0]
    for w, events in batches:
        batch = EventBatch(tuple(events), WORKERS[w], "life", seq[w], 1.0)
        seq[w] += 1
        assert new.apply(batch) is ref.apply(batch)
        for c in WIDE:
            for n in range(len(c) + 1):
                assert new.match(c[:n]) == ref.match(c[:n])
    new.check_invariants()
    assert new.snapshot() == ref.snapshot()
