"""The cache manager: computed prefix, allocation, free, fork/CoW, groups, stats, events."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh.errors import ConfigError, InvalidInput, PagesInUse, PoolExhausted
from kvmesh.events import PagesRemoved, PagesStored, replay_into
from kvmesh.hashing import ExtraKeys, PageHasher, RequestHashes
from kvmesh.types import PageHash
from kvmesh.worker.cache_manager import (
    KVCacheGroupSpec,
    KVCacheManager,
    PrefixCacheStats,
    Request,
    group_key,
)
from kvmesh.worker.page_pool import PagePool

PS = 4
HASHER = PageHasher(PS, seed="test")
SLIDING = KVCacheGroupSpec("sliding_window", sliding_window=9)


def make(num_pages: int = 16, **kw: Any) -> tuple[PagePool, KVCacheManager]:
    pool = PagePool(num_pages, page_size=PS, medium=kw.pop("medium", "cpu"))
    return pool, KVCacheManager(pool, PS, **kw)


def req(rid: str, tokens: list[int], keys: ExtraKeys | None = None, **kw: Any) -> Request:
    return Request(rid, RequestHashes(HASHER, tokens, keys or ExtraKeys()), **kw)


def run_prompt(mgr: KVCacheManager, r: Request) -> tuple[int, list[int]]:
    """Schedule a whole prompt: hits, then slots for the rest; returns (hit tokens, page ids)."""
    pages, n = mgr.get_computed_pages(r)
    new = mgr.allocate_slots(r, r.num_tokens - n, n, pages)
    assert new is not None
    return n, [p.page_id for p in mgr.get_pages(r.request_id)]


def state(pool: PagePool) -> tuple[Any, ...]:
    return (
        [p.page_id for p in pool.free_queue.get_all_free_pages()],
        [(p.ref_cnt, p.page_hash) for p in pool.pages],
        pool.cached_hashes(),
    )


PROMPT = list(range(10))  # two full pages and a partial one


def test_a_new_request_has_no_computed_pages() -> None:
    _, mgr = make()
    assert mgr.get_computed_pages(req("a", PROMPT)) == ([], 0)


def test_a_second_request_hits_the_cached_prefix_of_the_first() -> None:
    pool, mgr = make()
    _, first_pages = run_prompt(mgr, req("a", PROMPT))
    mgr.free("a")
    hit, pages = run_prompt(mgr, req("b", [*PROMPT[:8], 77, 78, 79]))
    assert hit == 8
    assert pages[:2] == first_pages[:2] and pages[2] != first_pages[2]
    pool.check_invariants()


def test_the_computed_prefix_never_covers_the_last_token() -> None:
    _, mgr = make()
    tokens = list(range(12))  # exactly three full pages
    run_prompt(mgr, req("a", tokens))
    pages, n = mgr.get_computed_pages(req("b", tokens))
    assert n == 8 and len(pages) == 2  # the third page holds the last token: recomputed
    pages, n = mgr.get_computed_pages(req("c", [*tokens, 5]))
    assert n == 12 and len(pages) == 3


def test_a_prompt_of_exactly_k_full_pages_caches_all_k() -> None:
    pool, mgr = make()
    run_prompt(mgr, req("a", list(range(12))))
    (ev,) = mgr.take_events()
    assert isinstance(ev, PagesStored) and len(ev.page_hashes) == 3
    assert ev.token_ids == tuple(range(12)) and ev.parent_hash is None
    assert pool.cached_hashes() == set(req("x", list(range(12))).page_hashes)


def test_a_one_token_prompt_has_nothing_to_hit_and_caches_nothing() -> None:
    _, mgr = make()
    r = req("a", [3])
    assert mgr.get_computed_pages(r) == ([], 0)
    assert mgr.allocate_slots(r, 1) is not None
    assert len(mgr.get_pages("a")) == 1 and mgr.take_events() == []


def test_no_computed_pages_when_caching_is_off() -> None:
    pool, mgr = make(enable_caching=False)
    run_prompt(mgr, req("a", PROMPT))
    mgr.free("a")
    assert mgr.get_computed_pages(req("b", PROMPT)) == ([], 0)
    assert pool.cached_hashes() == set() and mgr.take_events() == []
    with pytest.raises(InvalidInput, match="caching is off"):
        mgr.allocate_slots(req("c", PROMPT), 2, 8, pool.pages[1:3])


def test_a_pool_without_caching_turns_the_manager_off_too() -> None:
    pool = PagePool(8, page_size=PS, enable_caching=False)
    assert not KVCacheManager(pool, PS).enable_caching


def test_no_computed_pages_when_the_request_wants_prompt_logprobs() -> None:
    _, mgr = make()
    run_prompt(mgr, req("a", PROMPT))
    assert mgr.get_computed_pages(req("b", PROMPT, prompt_logprobs=True)) == ([], 0)


def test_allocate_returns_none_and_changes_nothing_when_the_pool_cannot_hold_it() -> None:
    pool, mgr = make(num_pages=6)  # five usable pages
    run_prompt(mgr, req("a", PROMPT))  # three pages, two cached
    mgr.free("a")
    run_prompt(mgr, req("b", list(range(100, 108))))  # two pages held
    mgr.take_events()
    before = state(pool)
    r = req("c", [*PROMPT[:8], *range(50, 62)])  # hits 2 free pages, needs 3 more
    pages, n = mgr.get_computed_pages(r)
    assert n == 8
    assert mgr.allocate_slots(r, r.num_tokens - n, n, pages) is None
    assert state(pool) == before and mgr.take_events() == []
    assert mgr.get_pages("c") == []
    pool.check_invariants()


def test_free_hit_pages_count_against_the_free_pool() -> None:
    pool, mgr = make(num_pages=5)  # four usable pages
    run_prompt(mgr, req("a", list(range(12))))  # three pages, all cached, then freed
    mgr.free("a")
    r = req("b", [*range(12), *range(20, 25)])  # hits three, needs two more: five > four
    pages, n = mgr.get_computed_pages(r)
    assert len(pages) == 3
    assert mgr.allocate_slots(r, r.num_tokens - n, n, pages) is None
    r = req("c", [*range(12), 1, 2])  # hits three, needs one more: fits exactly
    pages, n = mgr.get_computed_pages(r)
    assert mgr.allocate_slots(r, r.num_tokens - n, n, pages) is not None
    assert pool.get_num_free_pages() == 0
    pool.check_invariants()


def test_lookahead_allocates_pages_for_tokens_not_yet_known() -> None:
    _, mgr = make()
    r = req("a", PROMPT)
    new = mgr.allocate_slots(r, 10, lookahead=7)  # 17 tokens: five pages
    assert new is not None and len(new) == 5
    assert len(mgr.take_events()[0].page_hashes) == 2  # type: ignore[union-attr]


def test_delayed_caching_waits_for_cache_pages() -> None:
    pool, mgr = make()
    r = req("a", PROMPT)
    mgr.allocate_slots(r, 10, delay_caching=True)
    assert pool.cached_hashes() == set() and mgr.take_events() == []
    mgr.cache_pages(r, 10)
    assert pool.cached_hashes() == set(r.page_hashes)
    mgr.cache_pages(r, 10)
    assert len(mgr.take_events()) == 1


def test_decoding_extends_the_pages_and_caches_each_page_it_fills() -> None:
    pool, mgr = make()
    r = req("a", PROMPT)
    run_prompt(mgr, r)
    mgr.take_events()
    r.num_computed_tokens = 10
    for step, token in enumerate([50, 51, 52, 53, 54]):
        r.hashes.extend([token])
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        if step == 1:  # token 12 completes page 3
            (ev,) = mgr.take_events()
            assert isinstance(ev, PagesStored)
            assert ev.page_hashes == (r.page_hashes[2],) and ev.parent_hash == r.page_hashes[1]
            assert ev.token_ids == (8, 9, 50, 51)
        else:
            assert mgr.take_events() == []
    assert len(mgr.get_pages("a")) == 4
    pool.check_invariants()


def test_free_releases_the_pages_tail_first() -> None:
    pool, mgr = make(num_pages=6)
    _, ids = run_prompt(mgr, req("a", PROMPT))
    mgr.free("a")
    free = [p.page_id for p in pool.free_queue.get_all_free_pages()]
    assert free[-3:] == ids[::-1]
    assert mgr.get_pages("a") == []
    mgr.free("a")  # idempotent
    pool.check_invariants()


def test_only_a_new_request_may_bring_computed_pages() -> None:
    pool, mgr = make()
    run_prompt(mgr, req("a", PROMPT))
    r = req("b", PROMPT)
    run_prompt(mgr, r)
    before = state(pool)
    with pytest.raises(InvalidInput, match="already holds pages"):
        mgr.allocate_slots(r, 1, 8, mgr.get_pages("a")[:2])
    assert state(pool) == before


def test_negative_token_counts_are_rejected() -> None:
    _, mgr = make()
    with pytest.raises(InvalidInput, match="non-negative"):
        mgr.allocate_slots(req("a", PROMPT), -1)
    with pytest.raises(InvalidInput, match="non-negative"):
        mgr.allocate_slots(req("a", PROMPT), 1, lookahead=-2)


def test_common_prefix_pages_are_those_every_running_request_holds() -> None:
    _, mgr = make()
    run_prompt(mgr, req("a", [*range(8), 100, 101]))
    run_prompt(mgr, req("b", [*range(8), 200, 201, 202, 203, 204]))
    assert mgr.num_common_prefix_pages("a") == [2]
    run_prompt(mgr, req("c", [*range(4), 9, 9, 9, 9, 9]))
    assert mgr.num_common_prefix_pages("a") == [1]
    assert mgr.num_common_prefix_pages("a", num_running_requests=2) == [0]
    assert mgr.num_common_prefix_pages("zz") == [0]


def test_prefix_cache_stats_count_queries_and_hits_per_request_and_in_total() -> None:
    _, mgr = make()
    run_prompt(mgr, req("a", PROMPT))
    assert mgr.request_stats("a") == PrefixCacheStats(1, 10, 0)
    run_prompt(mgr, req("b", PROMPT))
    assert mgr.request_stats("b") == PrefixCacheStats(1, 10, 8)
    assert mgr.stats == PrefixCacheStats(2, 20, 8)
    assert mgr.stats.hit_ratio == 0.4
    mgr.free("b")
    assert mgr.request_stats("b") is None
    assert mgr.stats.requests == 2


def test_fork_shares_every_page_by_reference_count() -> None:
    pool, mgr = make()
    run_prompt(mgr, req("a", PROMPT))
    child = mgr.fork("a", "a.1")
    assert child == mgr.get_pages("a") and child is not mgr.get_pages("a")
    assert [p.ref_cnt for p in child] == [2, 2, 2]
    mgr.free("a")
    assert [p.ref_cnt for p in child] == [1, 1, 1]
    mgr.free("a.1")
    assert pool.get_num_free_pages() == 15
    pool.check_invariants()


def test_fork_needs_a_parent_with_pages_and_a_new_child() -> None:
    _, mgr = make()
    with pytest.raises(InvalidInput, match="holds no pages"):
        mgr.fork("nobody", "x")
    run_prompt(mgr, req("a", PROMPT))
    run_prompt(mgr, req("b", PROMPT))
    with pytest.raises(InvalidInput, match="already holds pages"):
        mgr.fork("a", "b")


def test_writing_a_shared_page_copies_it_first() -> None:
    pool, mgr = make()
    run_prompt(mgr, req("a", PROMPT))
    mgr.fork("a", "a.1")
    tail = mgr.get_pages("a")[2]
    new_id, source = mgr.prepare_write("a.1", 2)
    assert source == tail.page_id and new_id != tail.page_id
    assert mgr.get_pages("a.1")[2].page_id == new_id
    assert mgr.get_pages("a")[2] is tail and tail.ref_cnt == 1
    assert mgr.prepare_write("a.1", 2) == (new_id, None)  # now private: in place
    assert mgr.prepare_write("a", -1) == (tail.page_id, None)
    pool.check_invariants()


def test_writing_a_cached_page_copies_it_and_keeps_the_cached_one() -> None:
    pool, mgr = make()
    r = req("a", PROMPT)
    run_prompt(mgr, r)
    first = mgr.get_pages("a")[0]
    new_id, source = mgr.prepare_write("a", 0)
    assert source == first.page_id and new_id != first.page_id
    assert first.ref_cnt == 0 and pool.get_cached_page(r.page_hashes[0]) is first
    assert pool.pages[new_id].page_hash is None
    pool.check_invariants()


def test_a_copy_on_write_with_no_free_page_raises_and_changes_nothing() -> None:
    pool, mgr = make(num_pages=4)
    run_prompt(mgr, req("a", PROMPT))
    mgr.fork("a", "a.1")
    before = state(pool)
    with pytest.raises(PoolExhausted):
        mgr.prepare_write("a.1", 0)
    assert state(pool) == before


def test_prepare_write_rejects_bad_arguments() -> None:
    _, mgr = make()
    with pytest.raises(InvalidInput, match="holds no pages"):
        mgr.prepare_write("nobody", 0)
    run_prompt(mgr, req("a", PROMPT))
    with pytest.raises(InvalidInput, match="out of range"):
        mgr.prepare_write("a", 3)
    with pytest.raises(InvalidInput, match="group 1 does not exist"):
        mgr.prepare_write("a", 0, group=1)


def test_with_eagle_the_last_matched_page_is_recomputed() -> None:
    _, mgr = make(use_eagle=True)
    run_prompt(mgr, req("a", list(range(13))))
    pages, n = mgr.get_computed_pages(req("b", list(range(13))))
    assert n == 8 and len(pages) == 2  # three pages match; EAGLE drops the last


def test_events_carry_the_lora_id_and_the_pool_medium() -> None:
    _, mgr = make(medium="gpu")
    run_prompt(mgr, req("a", PROMPT, ExtraKeys(lora_id=5)))
    (ev,) = mgr.take_events()
    assert isinstance(ev, PagesStored) and (ev.lora_id, ev.medium, ev.page_size) == (5, "gpu", PS)


def test_different_cache_salts_never_share_a_page() -> None:
    _, mgr = make()
    run_prompt(mgr, req("a", PROMPT, ExtraKeys(cache_salt="tenant-1")))
    assert mgr.get_computed_pages(req("b", PROMPT, ExtraKeys(cache_salt="tenant-2")))[1] == 0
    assert mgr.get_computed_pages(req("c", PROMPT, ExtraKeys(cache_salt="tenant-1")))[1] == 8


def test_replaying_the_events_gives_the_cached_set_after_eviction() -> None:
    pool, mgr = make(num_pages=6)
    seen: set[PageHash] = set()
    removed = 0
    for i in range(6):
        r = req(f"r{i}", [*PROMPT[: 4 * (i % 3)], *range(20 * i, 20 * i + 9)])
        run_prompt(mgr, r)
        mgr.free(r)
        events = mgr.take_events()
        removed += sum(isinstance(e, PagesRemoved) for e in events)
        replay_into(seen, events)
        assert seen == pool.cached_hashes()
    assert removed > 0


def test_reset_goes_through_the_manager_and_refuses_while_requests_run() -> None:
    pool, mgr = make()
    run_prompt(mgr, req("a", PROMPT))
    with pytest.raises(PagesInUse, match="3 pages are held"):
        mgr.reset_prefix_cache()
    mgr.free("a")
    mgr.reset_prefix_cache()
    assert pool.cached_hashes() == set() and mgr.usage == 0.0


def test_the_manager_page_size_must_match_the_pool() -> None:
    with pytest.raises(ConfigError, match="page_size 8 differs"):
        KVCacheManager(PagePool(4, page_size=4), 8)
    with pytest.raises(ConfigError, match="at least one"):
        KVCacheManager(PagePool(4, page_size=4), 4, groups=())


def test_group_specs_are_checked() -> None:
    with pytest.raises(ConfigError, match="unknown KV-cache group kind"):
        KVCacheGroupSpec("mamba")
    with pytest.raises(ConfigError, match="window of at least 1"):
        KVCacheGroupSpec("sliding_window")


# --------------------------------------------------------------- KV-cache groups


def test_a_sliding_window_needs_only_the_pages_its_window_covers() -> None:
    pool, mgr = make(groups=[SLIDING])  # window 9: a token sees the 8 before it, 2 pages
    tokens = list(range(21))
    r = req("a", tokens)
    run_prompt(mgr, r)
    mgr.free(r)
    keys = r.page_hashes
    pool.evict_pages(keys[:2])  # the first two pages are gone
    (pages,), n = mgr.get_computed_pages_by_group(req("b", tokens))
    assert n == 20 and len(pages) == 5
    assert [p.is_null for p in pages] == [True, True, True, False, False]
    new = mgr.allocate_slots(req("b", tokens), 1, 20, (pages,))
    assert new is not None and len(new) == 1
    assert pool.null_page.ref_cnt == 3
    mgr.free("b")
    assert pool.null_page.ref_cnt == 0
    pool.check_invariants()


def test_a_sliding_window_hit_from_the_start_counts_without_a_full_window() -> None:
    pool, mgr = make(groups=[KVCacheGroupSpec("sliding_window", sliding_window=13)])
    r = req("a", list(range(21)))
    run_prompt(mgr, r)
    mgr.free(r)
    pool.evict_pages([r.page_hashes[2]])
    pages, n = mgr.get_computed_pages(req("b", list(range(21))))
    assert n == 8 and not any(p.is_null for p in pages)


def test_pages_that_slide_out_of_the_window_are_freed() -> None:
    pool, mgr = make(groups=[SLIDING])
    r = req("a", list(range(17)))
    run_prompt(mgr, r)
    r.num_computed_tokens = 17
    r.hashes.extend([1])
    held = pool.get_num_free_pages()
    assert mgr.allocate_slots(r, 1) is not None
    # tokens 0..8 are out of the 9-token window ending at token 17: pages 0-1 freed
    assert [p.is_null for p in mgr.get_pages("a")] == [True, True, False, False, False]
    assert pool.get_num_free_pages() == held + 2
    pool.check_invariants()


def test_hybrid_groups_take_the_prefix_that_is_valid_for_every_group() -> None:
    pool, mgr = make(num_pages=32, groups=[KVCacheGroupSpec(), SLIDING])
    tokens = list(range(21))
    r = req("a", tokens)
    run_prompt(mgr, r)
    mgr.free(r)
    full_keys = r.page_hashes
    slide_keys = [group_key(k, 1) for k in full_keys]
    assert pool.cached_hashes() == set(full_keys) | set(slide_keys)
    # The sliding group lost page 3: its longest valid prefix ends at page 3
    # (pages 1-2 hit), and the full-attention group follows it down.
    pool.evict_pages([slide_keys[3]])
    (full, slide), n = mgr.get_computed_pages_by_group(req("b", tokens))
    assert n == 12 and len(full) == len(slide) == 3
    assert not any(p.is_null for p in full) and [p.is_null for p in slide] == [True, False, False]
    new = mgr.allocate_slots(req("b", tokens), 9, 12, (full, slide))
    assert new is not None and len(new) == 3
    assert [len(p) for p in mgr.get_pages_by_group("b")] == [6, 6]
    pool.check_invariants()


def test_groups_never_hit_each_others_pages() -> None:
    pool, mgr = make(num_pages=32, groups=[KVCacheGroupSpec(), KVCacheGroupSpec()])
    r = req("a", PROMPT)
    run_prompt_groups(mgr, r)
    mgr.free(r)
    pool.evict_pages([group_key(r.page_hashes[0], 1)])
    _, n = mgr.get_computed_pages_by_group(req("b", PROMPT))
    assert n == 0


def test_several_groups_need_the_per_group_computed_pages() -> None:
    _, mgr = make(groups=[KVCacheGroupSpec(), SLIDING])
    run_prompt_groups(mgr, req("a", PROMPT))
    pages, n = mgr.get_computed_pages(req("b", PROMPT))
    assert n == 8
    with pytest.raises(InvalidInput, match="per-group tuple"):
        mgr.allocate_slots(req("b", PROMPT), 2, n, pages)
    with pytest.raises(InvalidInput, match="for 1 groups"):
        mgr.allocate_slots(req("b", PROMPT), 2, n, (pages,))


def run_prompt_groups(mgr: KVCacheManager, r: Request) -> None:
    by_group, n = mgr.get_computed_pages_by_group(r)
    assert mgr.allocate_slots(r, r.num_tokens - n, n, by_group) is not None


def test_lookups_of_requests_that_never_get_pages_are_not_kept() -> None:
    _, mgr = make()
    for i in range(5):
        mgr.get_computed_pages(req(f"probe{i}", PROMPT))
    assert mgr.request_stats("probe4") == PrefixCacheStats(1, 10, 0)
    assert mgr.request_stats("probe0") is None
    assert mgr.stats.requests == 5
    assert mgr._req_stats == {}


def test_a_sliding_window_group_has_no_common_prefix() -> None:
    _, mgr = make(groups=[KVCacheGroupSpec(), SLIDING])
    run_prompt_groups(mgr, req("a", PROMPT))
    assert mgr.num_common_prefix_pages("a") == [3, 0]


def test_a_manager_is_built_from_the_pool_config() -> None:
    from kvmesh.config import PoolConfig

    cfg = PoolConfig(num_pages=8, use_eagle=True)
    pool = PagePool.from_config(cfg, page_size=PS)
    mgr = KVCacheManager.from_config(pool, cfg)
    assert mgr.use_eagle and mgr.enable_caching and mgr.page_size == PS
