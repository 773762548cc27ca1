"""Property test: random request lifecycles never break the pool's invariants.

A hypothesis state machine drives one cache manager over a small pool with
random allocate / decode / free / fork / copy-on-write / evict / reset / hit
steps (prompts share prefixes, so pages are hit, shared and evicted), under
one full-attention group, a sliding window, or both. After every step:

- `check_invariants` (each non-null page is in the free queue with ref count 0
  or held with ref count > 0, never both; the queue's length is the number of
  free pages; the hash map and the pages agree);
- every page's ref count equals the number of request page lists holding it;
- replaying all events into a set gives exactly the pool's cached hashes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvmesh.errors import PagesInUse, PoolExhausted
from kvmesh.events import replay_into
from kvmesh.hashing import PageHasher, RequestHashes
from kvmesh.types import PageHash
from kvmesh.worker.cache_manager import KVCacheGroupSpec, KVCacheManager, Request
from kvmesh.worker.page_pool import PagePool

PS = 2
HASHER = PageHasher(PS, seed="stateful")
BASES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 6, 6, 7, 7, 8, 8]]
GROUPS = {
    "full": [KVCacheGroupSpec()],
    "sliding": [KVCacheGroupSpec("sliding_window", sliding_window=3)],
    "hybrid": [KVCacheGroupSpec(), KVCacheGroupSpec("sliding_window", sliding_window=5)],
}


def snapshot(pool: PagePool) -> tuple[Any, ...]:
    return (
        [p.page_id for p in pool.free_queue.get_all_free_pages()],
        [(p.ref_cnt, p.page_hash) for p in pool.pages],
    )


class PoolMachine(RuleBasedStateMachine):
    pool: PagePool
    mgr: KVCacheManager

    @initialize(
        groups=st.sampled_from(sorted(GROUPS)),
        num_pages=st.integers(3, 16),
        eagle=st.booleans(),
    )
    def setup(self, groups: str, num_pages: int, eagle: bool) -> None:
        self.pool = PagePool(num_pages, page_size=PS)
        self.mgr = KVCacheManager(self.pool, PS, groups=GROUPS[groups], use_eagle=eagle)
        self.requests: dict[str, Request] = {}
        self.seen: set[PageHash] = set()
        self.count = 0

    def _new_id(self) -> str:
        self.count += 1
        return f"r{self.count}"

    def _pick(self, data: st.DataObject) -> Request:
        return self.requests[data.draw(st.sampled_from(sorted(self.requests)))]

    @rule(
        base=st.integers(0, len(BASES) - 1),
        keep=st.integers(0, 8),
        extra=st.lists(st.integers(0, 3), max_size=6),
        delay=st.booleans(),
    )
    def start_request(self, base: int, keep: int, extra: list[int], delay: bool) -> None:
        tokens = BASES[base][:keep] + extra
        if not tokens:
            return
        r = Request(self._new_id(), RequestHashes(HASHER, tokens))
        by_group, n = self.mgr.get_computed_pages_by_group(r)
        assert n <= r.num_tokens - 1
        before = snapshot(self.pool)
        new = self.mgr.allocate_slots(r, r.num_tokens - n, n, by_group, delay_caching=delay)
        if new is None:
            assert snapshot(self.pool) == before
            assert self.mgr.get_pages(r.request_id) == []
            return
        if delay:
            self.mgr.cache_pages(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        self.requests[r.request_id] = r

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def decode(self, data: st.DataObject, new_tokens: list[int]) -> None:
        r = self._pick(data)
        rid = r.request_id
        # A correct caller makes the partial last page private before writing into it.
        if r.num_computed_tokens % PS:
            idx = r.num_computed_tokens // PS
            try:
                for g in range(len(self.mgr.groups)):
                    self.mgr.prepare_write(rid, idx, group=g)
            except PoolExhausted:
                return
        r.hashes.extend(new_tokens)
        before = snapshot(self.pool)
        if self.mgr.allocate_slots(r, len(new_tokens)) is None:
            assert snapshot(self.pool) == before
            del r.hashes.token_ids[-len(new_tokens) :]  # the step did not happen
            del r.hashes.hashes[len(r.hashes.token_ids) // PS :]
            return
        r.num_computed_tokens += len(new_tokens)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        r = self._pick(data)
        self.mgr.free(r)
        del self.requests[r.request_id]

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self._pick(data)
        child = Request(self._new_id(), RequestHashes(HASHER, parent.token_ids))
        child.num_computed_tokens = parent.num_computed_tokens
        self.mgr.fork(parent, child.request_id)
        self.requests[child.request_id] = child

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        r = self._pick(data)
        pages = self.mgr.get_pages(r.request_id)
        live = [i for i, p in enumerate(pages) if not p.is_null]
        if not live:
            return
        idx = data.draw(st.sampled_from(live))
        before = snapshot(self.pool)
        old = pages[idx]
        try:
            page_id, source = self.mgr.prepare_write(r.request_id, idx)
        except PoolExhausted:
            assert snapshot(self.pool) == before
            return
        now = self.mgr.get_pages(r.request_id)[idx]
        assert now.page_id == page_id and now.ref_cnt == 1 and now.page_hash is None
        assert (source is None) == (now is old)
        if source is not None:
            assert source == old.page_id

    @precondition(lambda self: self.pool.num_cached_hashes() > 0)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        cached = sorted(self.pool.cached_hashes())
        chosen = data.draw(st.lists(st.sampled_from(cached), max_size=3, unique=True))
        assert self.pool.evict_pages(chosen) == len(chosen)

    @rule()
    def reset(self) -> None:
        held = self.pool.num_pages - 1 - self.pool.get_num_free_pages()
        try:
            self.mgr.reset_prefix_cache()
        except PagesInUse:
            assert held > 0
        else:
            assert held == 0 and self.pool.cached_hashes() == set()

    @rule(base=st.integers(0, len(BASES) - 1), keep=st.integers(1, 8))
    def lookup(self, base: int, keep: int) -> None:
        r = Request("probe", RequestHashes(HASHER, BASES[base][:keep]))
        by_group, n = self.mgr.get_computed_pages_by_group(r)
        assert n <= r.num_tokens - 1 and n % PS == 0
        for g, pages in enumerate(by_group):
            assert len(pages) * PS == n
            for i, p in enumerate(pages):
                if not p.is_null:
                    assert p.page_hash is not None
                    assert p.page_hash[: len(r.page_hashes[i])] == r.page_hashes[i]
                    assert len(p.page_hash) == len(r.page_hashes[i]) + (2 if g else 0)

    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        refs: Counter[int] = Counter()
        for rid in self.requests:
            for pages in self.mgr.get_pages_by_group(rid):
                refs.update(p.page_id for p in pages)
        for page in self.pool.pages:
            assert page.ref_cnt == refs[page.page_id], (page, refs[page.page_id])

    @invariant()
    def events_replay_to_the_cached_set(self) -> None:
        if not hasattr(self, "pool"):
            return
        replay_into(self.seen, self.mgr.take_events())
        assert self.seen == self.pool.cached_hashes()


PoolMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pool_state_machine = PoolMachine.TestCase
