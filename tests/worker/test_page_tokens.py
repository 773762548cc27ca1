"""PageTokens: what a sender remembers of its cached pages' tokens, and when it offers them."""

from __future__ import annotations

from kvmesh.events import AllPagesCleared, PagesRemoved, PagesStored
from kvmesh.hashing import ExtraKeys, PageHasher
from kvmesh.types import PageHash
from kvmesh.worker.page_tokens import PageTokens

PAGE = 4


def stored(hashes: list[PageHash], tokens: list[int]) -> PagesStored:
    return PagesStored(tuple(hashes), None, tuple(tokens), PAGE)


def test_stored_events_teach_each_pages_tokens_and_removals_forget_them() -> None:
    memory = PageTokens(PageHasher(PAGE, seed="s"), num_pages=8)
    hashes = [PageHash(b"a"), PageHash(b"b")]
    memory.learn([stored(hashes, list(range(8)))], set)
    assert memory.get(hashes[0]) == (0, 1, 2, 3) and memory.get(hashes[1]) == (4, 5, 6, 7)
    memory.learn([PagesRemoved((hashes[0],))], set)
    assert hashes[0] not in memory and hashes[1] in memory
    memory.learn([AllPagesCleared()], set)
    assert len(memory) == 0


def test_an_event_whose_tokens_do_not_cover_its_pages_teaches_nothing() -> None:
    memory = PageTokens(PageHasher(PAGE, seed="s"), num_pages=8)
    memory.learn([stored([PageHash(b"a"), PageHash(b"b")], [1, 2, 3, 4])], set)
    assert len(memory) == 0


def test_memory_past_twice_the_pool_is_pruned_to_the_cached_pages() -> None:
    memory = PageTokens(PageHasher(PAGE, seed="s"), num_pages=1)
    keep = PageHash(b"k")
    for i in range(2):
        memory.remember(PageHash(bytes([i])), (i,) * PAGE)
    memory.learn([stored([keep], [9] * PAGE)], lambda: {keep})
    assert len(memory) == 1 and keep in memory


def test_tokens_are_offered_only_when_they_prove_the_hash() -> None:
    hasher = PageHasher(PAGE, seed="s")
    memory = PageTokens(hasher, num_pages=4)
    tokens = [1, 2, 3, 4]
    plain = hasher.hash_prompt(tokens)[0]
    lora = hasher.hash_prompt(tokens, ExtraKeys(lora_id=3))[0]
    salted = hasher.hash_prompt(tokens, ExtraKeys(cache_salt="t"))[0]
    assert memory.provable(plain, None, tokens, None) == tuple(tokens)
    assert memory.provable(lora, None, tokens, 3) == tuple(tokens)
    assert memory.provable(salted, None, tokens, None) == ()
    assert memory.provable(plain, None, None, None) == ()
    assert memory.provable(plain, None, [1, 2], None) == ()  # not a whole page
