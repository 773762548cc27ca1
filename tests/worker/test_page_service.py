"""PageService: lookup, pin/unpin, export, checked insert over a real pool and KV store."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch

from kvmesh.errors import (
    ChecksumMismatch,
    HashMismatch,
    InvalidInput,
    PageFormatError,
    PoolExhausted,
)
from kvmesh.events import PagesStored
from kvmesh.hashing import NO_EXTRA, ExtraKeys, PageHasher
from kvmesh.types import PageHash, PageId
from kvmesh.worker.kv_store import KVStore, PageBlob
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import IncomingPage, PageService

PAGE = 4


def make_service(num_pages: int = 16, dtype: str = "float32") -> PageService:
    pool = PagePool(num_pages, page_size=PAGE)
    store = KVStore(
        num_pages, num_layers=2, num_kv_heads=2, head_dim=4, page_size=PAGE, dtype=dtype
    )
    return PageService(pool, store, PageHasher(PAGE, seed="test-seed"))


def tokens_for(n_pages: int, start: int = 0) -> list[int]:
    return [(start + i) % 250 for i in range(n_pages * PAGE)]


def fill(
    service: PageService, n_pages: int, *, start: int = 0, keys: ExtraKeys = NO_EXTRA
) -> tuple[list[PageHash], list[int]]:
    """Cache `n_pages` computed pages (random KV) the way a worker does; returns hashes, tokens."""
    tokens = tokens_for(n_pages, start)
    hashes = service.hasher.hash_prompt(tokens, keys)
    pool, store = service.pool, service.store
    pages = pool.get_new_pages(n_pages)
    gen = torch.Generator().manual_seed(start)
    for page in pages:
        data = torch.randn(store.page_shape, generator=gen).to(store.dtype)
        store.write_page(page.page_id, data)
    pool.cache_full_pages(pages, hashes, 0, n_pages, tokens, keys.lora_id)
    pool.free_pages(list(reversed(pages)))
    service.take_events()
    return hashes, tokens


def incoming(
    sender: PageService, hashes: list[PageHash], tokens: list[int], i: int, lora: int | None = None
) -> IncomingPage:
    with sender.pinned([hashes[i]]) as (pid,):
        assert pid is not None
        blob = sender.store.export_page(pid, copy=True)
    parent = hashes[i - 1] if i else None
    return IncomingPage(hashes[i], parent, tuple(tokens[i * PAGE : (i + 1) * PAGE]), blob, lora)


def state(service: PageService) -> tuple[Any, ...]:
    pool = service.pool
    return (
        service.ref_counts(),
        pool.cached_hashes(),
        pool.get_num_free_pages(),
        [p.page_id for p in pool.free_queue.get_all_free_pages()],
        service.store.kv.clone(),
    )


def assert_unchanged(service: PageService, before: tuple[Any, ...]) -> None:
    after = state(service)
    assert after[:4] == before[:4]
    assert torch.equal(after[4], before[4])
    assert service.pool.take_events() == []


def test_lookup_answers_in_request_order_and_prefix_length_stops_at_the_first_miss() -> None:
    service = make_service()
    hashes, _ = fill(service, 3)
    other = service.hasher.hash_prompt(tokens_for(1, start=100))[0]
    asked = [hashes[0], other, hashes[2], hashes[1]]
    assert service.lookup(asked) == [True, False, True, True]
    assert service.prefix_length(asked) == 1
    assert service.prefix_length(hashes) == 3
    assert service.ref_counts()[1:4] == [0, 0, 0]


def test_pin_takes_a_reference_on_hits_and_unpin_gives_it_back() -> None:
    service = make_service()
    hashes, _ = fill(service, 3)
    miss = PageHash(b"\x01" * 32)
    ids = service.pin([hashes[0], miss, hashes[2]])
    assert ids[1] is None
    counts = service.ref_counts()
    assert [counts[pid] for pid in ids if pid is not None] == [1, 1]
    service.unpin(ids)
    assert all(c == 0 for c in service.ref_counts())
    service.check_invariants()


def test_pinned_pages_survive_allocation_pressure() -> None:
    service = make_service(num_pages=6)
    hashes, _ = fill(service, 3)
    ids = service.pin(hashes[:1])
    pool = service.pool
    with pytest.raises(PoolExhausted):
        pool.get_new_pages(5)
    taken = pool.get_new_pages(4)  # every free page: the unpinned cached ones are reused
    assert service.lookup(hashes) == [True, False, False]
    pool.free_pages(taken)
    service.unpin(ids)
    service.check_invariants()


def test_pinned_context_releases_the_pages_when_the_block_raises() -> None:
    service = make_service()
    hashes, _ = fill(service, 2)
    with pytest.raises(RuntimeError), service.pinned(hashes) as ids:
        assert all(service.ref_counts()[pid] == 1 for pid in ids if pid is not None)
        raise RuntimeError("stream broke")
    assert all(c == 0 for c in service.ref_counts())


def test_a_hash_pinned_twice_needs_two_unpins() -> None:
    service = make_service()
    hashes, _ = fill(service, 1)
    ids = service.pin([hashes[0], hashes[0]])
    assert ids[0] == ids[1] and ids[0] is not None
    assert service.ref_counts()[ids[0]] == 2
    service.unpin(ids)
    assert service.ref_counts()[ids[0]] == 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_inserted_pages_are_bit_exact_cached_and_evictable(dtype: str) -> None:
    sender, receiver = make_service(dtype=dtype), make_service(dtype=dtype)
    hashes, tokens = fill(sender, 3)
    pages = [incoming(sender, hashes, tokens, i) for i in range(3)]
    assert receiver.insert_many(pages) == [True, True, True]
    assert receiver.lookup(hashes) == [True, True, True]
    assert all(c == 0 for c in receiver.ref_counts())
    for h in hashes:
        (src,) = sender.pin([h])
        (dst,) = receiver.pin([h])
        assert src is not None and dst is not None
        assert bytes(sender.export(src).data) == bytes(receiver.export(dst).data)
        sender.unpin([src])
        receiver.unpin([dst])
    stored = [e for e in receiver.take_events() if isinstance(e, PagesStored)]
    assert [e.page_hashes[0] for e in stored] == hashes
    assert stored[1].parent_hash == hashes[0]
    assert stored[2].token_ids == tuple(tokens[2 * PAGE :])
    receiver.check_invariants()


def test_a_page_already_held_is_skipped_not_overwritten() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 1)
    fill(receiver, 1)  # same tokens, same hash, different random bytes
    before = state(receiver)
    assert (
        receiver.insert(hashes[0], None, tokens[:PAGE], incoming(sender, hashes, tokens, 0).blob)
        is False
    )
    assert_unchanged(receiver, before)


def test_tokens_that_do_not_hash_to_the_page_are_refused_and_change_nothing() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 2)
    page = incoming(sender, hashes, tokens, 1)
    before = state(receiver)
    wrong = (page.token_ids[0] + 1, *page.token_ids[1:])
    with pytest.raises(HashMismatch, match="do not hash"):
        receiver.insert_many([dataclasses.replace(page, token_ids=wrong)])
    with pytest.raises(HashMismatch):
        receiver.insert_many([dataclasses.replace(page, parent_hash=hashes[1])])
    assert_unchanged(receiver, before)


def test_corrupted_or_misshapen_pages_are_refused_and_change_nothing() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 1)
    page = incoming(sender, hashes, tokens, 0)
    flipped = bytearray(page.blob.data)
    flipped[3] ^= 0x80
    before = state(receiver)
    with pytest.raises(ChecksumMismatch):
        receiver.insert_many(
            [dataclasses.replace(page, blob=dataclasses.replace(page.blob, data=bytes(flipped)))]
        )
    half = make_service(dtype="float16")
    fill(half, 1)
    with half.pinned(hashes) as (pid,):
        assert pid is not None
        f16 = half.store.export_page(pid, copy=True)
    with pytest.raises(PageFormatError):
        receiver.insert_many([dataclasses.replace(page, blob=f16)])
    with pytest.raises(InvalidInput, match="page hash"):
        receiver.insert_many([dataclasses.replace(page, page_hash=PageHash(b""))])
    assert_unchanged(receiver, before)


def test_one_bad_page_in_a_batch_inserts_none_of_it() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 3)
    pages = [incoming(sender, hashes, tokens, i) for i in range(3)]
    pages[2] = dataclasses.replace(pages[2], blob=dataclasses.replace(pages[2].blob, checksum=0))
    before = state(receiver)
    with pytest.raises(ChecksumMismatch):
        receiver.insert_many(pages)
    assert_unchanged(receiver, before)


def test_a_full_pool_refuses_the_insert_and_changes_nothing() -> None:
    sender, receiver = make_service(), make_service(num_pages=4)
    hashes, tokens = fill(sender, 3)
    held = receiver.pool.get_new_pages(3)
    before = state(receiver)
    with pytest.raises(PoolExhausted):
        receiver.insert_many([incoming(sender, hashes, tokens, 0)])
    assert_unchanged(receiver, before)
    receiver.pool.free_pages(held)


def test_insert_evicts_the_least_recently_used_free_page_when_needed() -> None:
    sender, receiver = make_service(num_pages=32), make_service(num_pages=4)
    old, _ = fill(receiver, 3, start=50)
    hashes, tokens = fill(sender, 1)
    assert receiver.insert_many([incoming(sender, hashes, tokens, 0)]) == [True]
    # fill() freed its pages tail-first, so the old prefix lost its tail, not its head.
    assert receiver.lookup(old) == [True, True, False]
    receiver.check_invariants()


def test_duplicates_within_one_batch_are_inserted_once() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 1)
    page = incoming(sender, hashes, tokens, 0)
    assert receiver.insert_many([page, page]) == [True, False]
    assert receiver.pool.get_num_free_pages() == receiver.pool.num_pages - 1
    assert len(receiver.pool.get_cached_pages(hashes[0])) == 1


def test_pages_without_tokens_are_trusted_on_their_checksum() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 2, keys=ExtraKeys(cache_salt="tenant-a"))
    page = dataclasses.replace(incoming(sender, hashes, tokens, 0), token_ids=())
    assert receiver.insert_many([page]) == [True]
    with pytest.raises(HashMismatch):  # salt not derivable from tokens: tokens cannot prove it
        receiver.insert_many([incoming(sender, hashes, tokens, 0)])


def test_lora_pages_are_proven_with_the_lora_id_as_extra_key() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 2, keys=ExtraKeys(lora_id=7))
    assert receiver.insert_many(
        [incoming(sender, hashes, tokens, i, lora=7) for i in range(2)]
    ) == [
        True,
        True,
    ]
    other = make_service()
    with pytest.raises(HashMismatch):
        other.insert_many([incoming(sender, hashes, tokens, 0, lora=None)])


def test_page_info_offers_tokens_only_when_they_prove_the_hash() -> None:
    service = make_service()
    plain, tokens = fill(service, 2)
    salted, _ = fill(service, 2, start=40, keys=ExtraKeys(cache_salt="s"))
    ids = service.pin([plain[1], salted[0], salted[1]])
    infos = [service.page_info(pid) for pid in ids if pid is not None]
    assert infos[0].token_ids == tuple(tokens[PAGE:]) and infos[0].parent_hash == plain[0]
    assert infos[1].token_ids == ()  # the salted first page cannot be proven
    assert len(infos[2].token_ids) == PAGE  # later pages chain from it: provable
    assert infos[0].tier == "cpu"
    service.unpin(ids)
    with pytest.raises(InvalidInput, match="pin it first"):
        service.page_info(PageId(ids[0] or 1))


def test_evicted_hashes_lose_their_remembered_tokens() -> None:
    service = make_service(num_pages=4)
    hashes, _ = fill(service, 3)
    service.pool.evict_pages(hashes[:1])
    service.take_events()
    fill(service, 1, start=90)
    ids = service.pin(hashes[1:2])
    assert ids[0] is not None
    assert len(service.page_info(ids[0]).token_ids) == PAGE
    service.unpin(ids)
    assert hashes[0] not in service._tokens


def test_mismatched_pool_and_store_are_refused() -> None:
    with pytest.raises(InvalidInput, match="pages"):
        PageService(PagePool(8, page_size=PAGE), KVStore(9, 1, 1, 4, PAGE), PageHasher(PAGE))
    with pytest.raises(InvalidInput, match="page sizes"):
        PageService(PagePool(8, page_size=PAGE), KVStore(8, 1, 1, 4, 8), PageHasher(PAGE))


def test_concurrent_inserts_of_the_same_pages_cache_each_hash_once() -> None:
    sender, receiver = make_service(num_pages=32), make_service(num_pages=32)
    hashes, tokens = fill(sender, 8)
    pages = [incoming(sender, hashes, tokens, i) for i in range(8)]
    results: list[list[bool]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for page in pages:
                results.append(receiver.insert_many([page]))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert sum(r[0] for r in results) == 8
    assert all(len(receiver.pool.get_cached_pages(h)) == 1 for h in hashes)
    assert all(c == 0 for c in receiver.ref_counts())
    receiver.check_invariants()


def test_blob_from_bytes_round_trips_through_insert() -> None:
    sender, receiver = make_service(dtype="bfloat16"), make_service(dtype="bfloat16")
    hashes, tokens = fill(sender, 1)
    page = incoming(sender, hashes, tokens, 0)
    blob = PageBlob.from_bytes(
        memoryview(bytearray(page.blob.data)), page.blob.dtype, page.blob.shape
    )
    assert receiver.insert(hashes[0], None, tokens[:PAGE], blob) is True


def receive_in_place(receiver: PageService, res: Any, page: IncomingPage) -> None:
    """What an in-place transport does: write the bytes into the reserved page, check them."""
    receiver.store.import_page(res.page_id, page.blob, verified=False)
    receiver.check(page)


def test_reserved_pages_are_cached_on_commit_bit_exact_and_evictable() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 3)
    reserved = receiver.reserve(hashes)
    assert all(r is not None for r in reserved)
    assert receiver.pool.cached_hashes() == set()  # held, not yet hit-able
    pages = [incoming(sender, hashes, tokens, i) for i in range(3)]
    for res, page in zip(reserved, pages, strict=True):
        assert res is not None
        receive_in_place(receiver, res, page)
    assert (
        receiver.commit([(r, p) for r, p in zip(reserved, pages, strict=True) if r]) == [True] * 3
    )
    assert receiver.lookup(hashes) == [True, True, True]
    assert receiver.ref_counts() == [0] * 16  # released: cached but evictable
    with receiver.pinned(hashes[:1]) as (pid,):
        assert pid is not None
        assert receiver.export(pid).data == pages[0].blob.data
    receiver.check_invariants()


def test_cached_repeated_and_in_flight_hashes_get_no_reservation() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 3)
    receiver.insert_many([incoming(sender, hashes, tokens, 0)])
    first = receiver.reserve([hashes[0], hashes[1], hashes[1]])
    assert [r is None for r in first] == [True, False, True]  # cached, new, repeated
    assert receiver.reserve([hashes[1]]) == [None]  # another transfer is receiving it
    assert first[1] is not None
    receiver.release([first[1]])
    again = receiver.reserve([hashes[1]])  # released: free to reserve again
    assert again[0] is not None
    receiver.release([again[0]])
    receiver.check_invariants()


def test_a_failed_check_or_a_release_frees_the_reservation_and_caches_nothing() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 2)
    free_before = receiver.pool.get_num_free_pages()
    reserved = receiver.reserve(hashes)
    assert receiver.pool.get_num_free_pages() == free_before - 2
    good = incoming(sender, hashes, tokens, 0)
    ok, bad = reserved
    assert ok is not None and bad is not None
    receive_in_place(receiver, ok, good)
    assert receiver.commit([(ok, good)], failed=[bad]) == [True]
    assert receiver.lookup(hashes) == [True, False]
    assert receiver.pool.get_num_free_pages() == free_before
    assert receiver.reserve([hashes[1]])[0] is not None  # not stuck "in flight"


def test_a_full_pool_reserves_nothing_and_changes_nothing() -> None:
    sender, receiver = make_service(), make_service(num_pages=4)
    hashes, _ = fill(sender, 3)
    held = receiver.pool.get_new_pages(2)
    before = state(receiver)
    assert receiver.reserve(hashes) == [None, None, None]
    assert_unchanged(receiver, before)
    receiver.pool.free_pages(held)


def test_committing_a_page_into_another_hashs_reservation_is_refused() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 2)
    res = receiver.reserve(hashes[:1])[0]
    assert res is not None
    with pytest.raises(InvalidInput, match="reserved for"):
        receiver.commit([(res, incoming(sender, hashes, tokens, 1))])
    receiver.release([res])
    receiver.check_invariants()
