"""The page pool: null page, ref counts, LRU eviction, hash map, events, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.config import PoolConfig
from kvmesh.errors import ConfigError, InvalidInput, InvariantViolation, PagesInUse, PoolExhausted
from kvmesh.events import AllPagesCleared, PagesRemoved, PagesStored, replay_into
from kvmesh.tenants import TenantWeights
from kvmesh.types import PageHash, PageId
from kvmesh.worker.free_queue import KVPage
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.tenant_share import make_eviction

PS = 4


def h(name: str) -> PageHash:
    return PageHash(name.encode().ljust(32, b"."))


def free_ids(pool: PagePool) -> list[int]:
    return [p.page_id for p in pool.free_queue.get_all_free_pages()]


def cache_chain(pool: PagePool, pages: list[KVPage], names: str) -> list[PageHash]:
    hashes = [h(c) for c in names]
    pool.cache_full_pages(pages, hashes, 0, len(hashes))
    return hashes


def test_page_zero_is_the_null_page_and_is_never_handed_out() -> None:
    pool = PagePool(4, page_size=PS)
    assert pool.null_page is pool.pages[0] and pool.null_page.is_null
    pages = pool.get_new_pages(3)
    assert sorted(p.page_id for p in pages) == [1, 2, 3]
    assert pool.get_num_free_pages() == 0
    pool.free_pages(pages)
    assert 0 not in free_ids(pool)
    pool.check_invariants()


def test_a_pool_needs_a_page_besides_the_null_page() -> None:
    with pytest.raises(ConfigError, match="at least 2"):
        PagePool(1)
    with pytest.raises(ConfigError, match="page_size"):
        PagePool(4, page_size=0)


def test_new_pages_come_from_the_head_of_the_queue_with_ref_count_one() -> None:
    pool = PagePool(6, page_size=PS)
    pages = pool.get_new_pages(2)
    assert [p.page_id for p in pages] == [1, 2]
    assert [p.ref_cnt for p in pages] == [1, 1]
    assert free_ids(pool) == [3, 4, 5]
    pool.check_invariants()


def test_an_exactly_full_pool_hands_out_every_page_and_then_refuses() -> None:
    pool = PagePool(5, page_size=PS)
    pages = pool.get_new_pages(4)
    assert pool.usage == 1.0 and pool.get_num_free_pages() == 0
    with pytest.raises(PoolExhausted, match="only 0 of 4 are free"):
        pool.get_new_pages(1)
    pool.free_pages(pages)
    assert pool.usage == 0.0
    pool.check_invariants()


def test_asking_for_more_pages_than_are_free_changes_nothing() -> None:
    pool = PagePool(5, page_size=PS)
    held = pool.get_new_pages(2)
    cache_chain(pool, held, "ab")
    pool.free_pages(reversed(held))
    pool.take_events()
    before = free_ids(pool)
    with pytest.raises(PoolExhausted):
        pool.get_new_pages(5)
    assert free_ids(pool) == before
    assert pool.cached_hashes() == {h("a"), h("b")}
    assert pool.take_events() == []
    with pytest.raises(InvalidInput):
        pool.get_new_pages(-1)
    pool.check_invariants()


def test_usage_is_the_fraction_of_non_null_pages_held() -> None:
    pool = PagePool(5, page_size=PS)
    assert pool.usage == 0.0
    pool.get_new_pages(1)
    assert pool.usage == 0.25


def test_a_freed_page_keeps_its_hash_and_can_still_be_hit() -> None:
    pool = PagePool(4, page_size=PS)
    (page,) = pool.get_new_pages(1)
    pool.cache_page(page, h("a"), None)
    pool.free_pages([page])
    assert page.ref_cnt == 0 and page.page_hash == h("a")
    assert pool.get_cached_page(h("a")) is page
    pool.touch([page])
    assert page.ref_cnt == 1 and page.page_id not in free_ids(pool)
    pool.check_invariants()


def test_touch_only_counts_up_a_held_page() -> None:
    pool = PagePool(4, page_size=PS)
    (page,) = pool.get_new_pages(1)
    pool.touch([page])
    assert page.ref_cnt == 2
    assert free_ids(pool) == [2, 3]
    pool.free_pages([page])
    assert page.ref_cnt == 1 and page.page_id not in free_ids(pool)
    pool.check_invariants()


def test_touching_a_free_page_twice_takes_it_out_once() -> None:
    pool = PagePool(4, page_size=PS)
    pages = pool.get_new_pages(1)
    pool.free_pages(pages)
    pool.touch([pages[0], pages[0]])
    assert pages[0].ref_cnt == 2
    assert pool.get_num_free_pages() == 2
    pool.check_invariants()


def test_touching_a_page_marked_free_but_not_queued_raises() -> None:
    pool = PagePool(4, page_size=PS)
    (page,) = pool.get_new_pages(1)
    page.ref_cnt = 0
    with pytest.raises(InvalidInput, match="not in the free queue"):
        pool.touch([page])


def test_freed_pages_are_evicted_tail_first() -> None:
    pool = PagePool(6, page_size=PS)
    pages = pool.get_new_pages(3)  # a request's pages 1, 2, 3
    cache_chain(pool, pages, "abc")
    pool.free_pages(reversed(pages))
    assert free_ids(pool) == [4, 5, 3, 2, 1]
    pool.take_events()
    reused = pool.get_new_pages(3)
    assert [p.page_id for p in reused] == [4, 5, 3]
    # The prefix's head ("a", "b") outlived its tail ("c").
    assert pool.cached_hashes() == {h("a"), h("b")}
    assert pool.take_events() == [PagesRemoved((h("c"),), "gpu")]
    pool.check_invariants()


def test_a_reused_page_loses_its_old_hash_before_it_is_handed_out() -> None:
    pool = PagePool(2, page_size=PS)
    (page,) = pool.get_new_pages(1)
    pool.cache_page(page, h("a"), None, [1, 2, 3, 4])
    pool.free_pages([page])
    (again,) = pool.get_new_pages(1)
    assert again is page and page.page_hash is None and page.parent_hash is None
    assert pool.get_cached_page(h("a")) is None
    pool.cache_page(page, h("b"), None)
    assert pool.take_events() == [
        PagesStored((h("a"),), None, (1, 2, 3, 4), PS, None, "gpu"),
        PagesRemoved((h("a"),), "gpu"),
        PagesStored((h("b"),), None, (), PS, None, "gpu"),
    ]
    pool.check_invariants()


def test_full_pages_are_cached_as_one_event_with_parent_tokens_and_lora() -> None:
    pool = PagePool(8, page_size=2, medium="gpu")
    pages = pool.get_new_pages(4)
    hashes = [h(c) for c in "abcd"]
    pool.cache_full_pages(pages, hashes, 1, 3, [9, 9, 5, 6, 7, 8, 0, 0], lora_id=7)
    assert pool.take_events() == [PagesStored((h("b"), h("c")), h("a"), (5, 6, 7, 8), 2, 7, "gpu")]
    assert pages[1].parent_hash == h("a") and pages[2].parent_hash == h("b")
    assert pages[0].page_hash is None and pages[3].page_hash is None
    pool.cache_full_pages(pages, hashes, 3, 3)  # nothing new: no event
    assert pool.take_events() == []
    pool.check_invariants()


def test_events_carry_no_token_ids_when_the_pool_is_told_so() -> None:
    pool = PagePool(4, page_size=2, event_token_ids=False)
    pages = pool.get_new_pages(1)
    pool.cache_full_pages(pages, [h("a")], 0, 1, [1, 2])
    (ev,) = pool.take_events()
    assert isinstance(ev, PagesStored) and ev.token_ids == ()


def test_duplicate_pages_with_one_hash_are_both_cached_and_announced_once() -> None:
    pool = PagePool(4, page_size=PS)
    first, second = pool.get_new_pages(2)
    pool.cache_page(first, h("a"), None)
    pool.cache_page(second, h("a"), None)
    assert {p.page_id for p in pool.get_cached_pages(h("a"))} == {1, 2}
    assert len(pool.take_events()) == 1
    pool.free_pages([second, first])
    pool.get_new_pages(2)  # page 3, then `second`: one copy evicted, the hash stays
    assert pool.get_cached_page(h("a")) is first
    assert pool.take_events() == []
    pool.get_new_pages(1)  # `first`: the last copy goes
    assert pool.take_events() == [PagesRemoved((h("a"),), "gpu")]
    pool.check_invariants()


def test_caching_a_run_around_an_existing_copy_splits_the_stored_event() -> None:
    pool = PagePool(8, page_size=1)
    (other,) = pool.get_new_pages(1)
    pool.cache_page(other, h("b"), h("a"), [2])
    pool.take_events()
    pages = pool.get_new_pages(3)
    hashes = [h("a"), h("b"), h("c")]
    pool.cache_full_pages(pages, hashes, 0, 3, [1, 2, 3])
    assert pool.take_events() == [
        PagesStored((h("a"),), None, (1,), 1, None, "gpu"),
        PagesStored((h("c"),), h("b"), (3,), 1, None, "gpu"),
    ]
    assert len(pool.get_cached_pages(h("b"))) == 2
    pool.check_invariants()


def test_only_held_non_null_pages_can_be_cached_and_only_once() -> None:
    pool = PagePool(4, page_size=PS)
    with pytest.raises(InvalidInput, match="null page"):
        pool.cache_page(pool.null_page, h("a"), None)
    (page,) = pool.get_new_pages(1)
    pool.free_pages([page])
    with pytest.raises(InvalidInput, match="not held"):
        pool.cache_page(page, h("a"), None)
    pool.touch([page])
    pool.cache_page(page, h("a"), None)
    pool.cache_page(page, h("a"), None)  # same hash again: no-op
    with pytest.raises(InvalidInput, match="another hash"):
        pool.cache_page(page, h("b"), None)
    with pytest.raises(InvalidInput, match="another hash"):
        pool.cache_full_pages([page], [h("b")], 0, 1)
    with pytest.raises(InvalidInput, match="holds 4 tokens"):
        pool.cache_page(pool.get_new_pages(1)[0], h("c"), None, [1, 2])
    assert pool.cached_hashes() == {h("a")}
    assert len(pool.take_events()) == 1
    pool.check_invariants()


def test_caching_past_the_request_pages_is_rejected() -> None:
    pool = PagePool(4, page_size=PS)
    pages = pool.get_new_pages(1)
    with pytest.raises(InvalidInput, match=r"cannot cache pages \[0:2\]"):
        pool.cache_full_pages(pages, [h("a"), h("b")], 0, 2)
    assert pool.cached_hashes() == set()


def test_match_prefix_stops_at_the_first_miss_and_the_cap() -> None:
    pool = PagePool(6, page_size=PS)
    pages = pool.get_new_pages(3)
    hashes = cache_chain(pool, pages, "abc")
    pool.evict_pages([h("b")])
    assert pool.match_prefix(hashes, 3) == [pages[0]]
    assert pool.match_prefix([h("a"), h("c")], 1) == [pages[0]]
    assert pool.match_prefix([h("z")], 3) == []


def test_evicting_by_hash_forgets_every_copy_and_counts_the_cached_ones() -> None:
    pool = PagePool(6, page_size=PS)
    pages = pool.get_new_pages(3)
    cache_chain(pool, pages, "abc")
    extra = pool.get_new_pages(1)
    pool.cache_page(extra[0], h("a"), None)
    pool.free_pages(reversed(pages))
    pool.take_events()
    assert pool.evict_pages([h("a"), h("c"), h("zz")]) == 2
    assert pool.cached_hashes() == {h("b")}
    assert pool.take_events() == [PagesRemoved((h("a"), h("c")), "gpu")]
    # A held page stays held; it just can no longer be hit.
    assert extra[0].ref_cnt == 1 and extra[0].page_hash is None
    assert pool.evict_pages([h("zz")]) == 0 and pool.take_events() == []
    pool.check_invariants()


def test_reset_refuses_while_pages_are_held_and_says_how_many() -> None:
    pool = PagePool(6, page_size=PS)
    pages = pool.get_new_pages(2)
    cache_chain(pool, pages, "ab")
    pool.take_events()
    with pytest.raises(PagesInUse, match="2 pages are held"):
        pool.reset_prefix_cache()
    assert pool.cached_hashes() == {h("a"), h("b")}
    assert pool.take_events() == []


def test_reset_forgets_every_hash_and_announces_it() -> None:
    pool = PagePool(6, page_size=PS)
    pages = pool.get_new_pages(2)
    cache_chain(pool, pages, "ab")
    pool.free_pages(pages)
    pool.take_events()
    pool.reset_prefix_cache()
    assert pool.cached_hashes() == set()
    assert all(p.page_hash is None for p in pool.pages)
    assert pool.take_events() == [AllPagesCleared()]
    assert pool.get_num_free_pages() == 5
    pool.check_invariants()


def test_take_events_drains_the_queue() -> None:
    pool = PagePool(4, page_size=PS)
    cache_chain(pool, pool.get_new_pages(1), "a")
    assert len(pool.take_events()) == 1
    assert pool.take_events() == []


def test_replaying_the_events_gives_the_cached_set() -> None:
    pool = PagePool(4, page_size=PS)
    seen: set[PageHash] = set()
    for names in ("ab", "cd", "ae", "fg"):
        pages = pool.get_new_pages(2)
        cache_chain(pool, pages, names)
        pool.free_pages(reversed(pages))
        replay_into(seen, pool.take_events())
        assert seen == pool.cached_hashes()


def test_a_snapshot_lists_the_cached_set_with_parents_before_children() -> None:
    pool = PagePool(8, page_size=PS, medium="cpu")
    pages = pool.get_new_pages(3)
    pool.cache_full_pages(pages, [h("a"), h("b"), h("c")], 0, 3, lora_id=3)
    (dup,) = pool.get_new_pages(1)
    pool.cache_page(dup, h("b"), h("a"))
    snap = pool.snapshot_events()
    assert [ev.page_hashes for ev in snap] == [(h("a"),), (h("b"),), (h("c"),)]
    assert [ev.parent_hash for ev in snap] == [None, h("a"), h("b")]
    assert {ev.lora_id for ev in snap} == {3}
    assert replay_into(set(), snap) == pool.cached_hashes()


def test_freeing_a_page_more_often_than_it_was_taken_is_an_invariant_violation() -> None:
    pool = PagePool(4, page_size=PS)
    (page,) = pool.get_new_pages(1)
    pool.free_pages([page])
    with pytest.raises(InvariantViolation, match="freed more often"):
        pool.free_pages([page])


def test_check_invariants_catches_a_page_both_free_and_held() -> None:
    pool = PagePool(4, page_size=PS)
    pool.pages[2].ref_cnt = 1
    with pytest.raises(InvariantViolation, match="page 2 is in the free queue with ref_cnt 1"):
        pool.check_invariants()


def test_check_invariants_catches_a_held_page_with_no_count() -> None:
    pool = PagePool(4, page_size=PS)
    (page,) = pool.get_new_pages(1)
    page.ref_cnt = 0
    with pytest.raises(InvariantViolation, match="not in the free queue"):
        pool.check_invariants()


def test_check_invariants_catches_a_hash_the_map_does_not_know() -> None:
    pool = PagePool(4, page_size=PS)
    (page,) = pool.get_new_pages(1)
    page.page_hash = h("x")
    with pytest.raises(InvariantViolation, match="does not map to it"):
        pool.check_invariants()


def test_check_invariants_catches_a_cached_null_page() -> None:
    pool = PagePool(4, page_size=PS)
    pool.null_page.page_hash = h("x")
    with pytest.raises(InvariantViolation, match="null page"):
        pool.check_invariants()


def test_a_pool_is_built_from_its_config() -> None:
    cfg = PoolConfig(num_pages=9, enable_caching=False, medium="gpu", event_token_ids=False)
    pool = PagePool.from_config(cfg, page_size=8)
    assert (pool.num_pages, pool.enable_caching, pool.medium, pool.page_size) == (
        9,
        False,
        "gpu",
        8,
    )
    assert not pool.event_token_ids
    assert pool.pages[3].page_id == PageId(3)


# ------------------------------------------------- evictions_for under fair eviction

TENANTS = ("t-a", "t-b", "t-c")
_POOL_OPS = st.lists(
    st.tuples(
        st.sampled_from(("serve", "free", "hit", "forget", "ask")),
        st.integers(0, 2),  # which tenant
        st.integers(1, 6),  # how many pages
        st.integers(0, 1_000),  # which request / hash
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=_POOL_OPS, weighted=st.booleans())
def test_evictions_for_is_what_an_allocation_then_evicts_under_fair_eviction(
    ops: list[tuple[str, int, int, int]], weighted: bool
) -> None:
    """`evictions_for` (the push-eviction budget) names the victims fair eviction
    really takes, whichever tenants hold which free pages."""
    pool = PagePool(17, page_size=PS)
    weights = TenantWeights({"t-a": 2.0}) if weighted else None
    pool.eviction = make_eviction("fair", weights)
    held: list[list[KVPage]] = []
    names = 0
    for op, t, n, pick in ops:
        tenant = TENANTS[t]
        if op in ("serve", "ask"):
            n = min(n, pool.get_num_free_pages())
            if not n:
                continue
            asked = tenant if op == "serve" else None
            expected = pool.evictions_for(n, asked)
            before = sum(pool.tenant_pages.values())
            pages = pool.get_new_pages(n, asked)
            assert before - sum(pool.tenant_pages.values()) == expected
            hashes = [h(f"{tenant}-{names + i}") for i in range(n)]
            names += n
            pool.cache_full_pages(pages, hashes, 0, n, tenant=tenant)
            held.append(pages)
        elif op == "free" and held:
            pool.free_pages(reversed(held.pop(pick % len(held))))
        elif op == "hit":
            cached = sorted(pool.cached_hashes())
            if cached:
                page = pool.get_cached_page(cached[pick % len(cached)])
                assert page is not None
                pool.touch([page])
                held.append([page])
        elif op == "forget":
            cached = sorted(pool.cached_hashes())
            if cached:
                pool.evict_pages([cached[pick % len(cached)]])
        pool.check_invariants()
