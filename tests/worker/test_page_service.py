"""PageService: lookup, pin/unpin, export, proven insert over a real pool and KV store.

Every page a receiver takes proves its hash against the receiver's own
`ProofBook` (built here with `proofs_for`, from the test's tokens and extra
keys, as a worker builds it from the request it serves); pushes come with a
grant (`PushGrants`) and are charged to the pusher's `EvictionBudget`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY
from worker_kit import proofs_for

from kvmesh.errors import (
    ChecksumMismatch,
    HashMismatch,
    InvalidInput,
    PageFormatError,
    PermissionDenied,
    PoolExhausted,
)
from kvmesh.events import PagesStored
from kvmesh.hashing import NO_EXTRA, ExtraKeys, PageHasher
from kvmesh.types import PageHash, PageId
from kvmesh.worker.kv_store import KVStore, PageBlob
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_service import (
    NO_PROOFS,
    EvictionBudget,
    IncomingPage,
    PageProof,
    PageService,
    ProofBook,
    PushGrants,
)

PAGE = 4


def make_service(num_pages: int = 16, dtype: str = "float32", **kw: Any) -> PageService:
    pool = PagePool(num_pages, page_size=PAGE)
    store = KVStore(
        num_pages, num_layers=2, num_kv_heads=2, head_dim=4, page_size=PAGE, dtype=dtype
    )
    return PageService(pool, store, PageHasher(PAGE, seed="test-seed"), **kw)


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


def book(service: PageService, tokens: list[int], keys: ExtraKeys = NO_EXTRA) -> ProofBook:
    """The receiver's own proofs for the pages of `tokens` (the request it serves)."""
    return proofs_for(service.hasher, tokens, keys)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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
    assert receiver.insert_many(pages, book(receiver, tokens)) == [True, True, True]
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
    blob = incoming(sender, hashes, tokens, 0).blob
    assert receiver.insert(hashes[0], blob, book(receiver, tokens)) is False
    assert_unchanged(receiver, before)


def test_proof_tokens_that_do_not_hash_to_the_page_are_refused_and_change_nothing() -> None:
    """The receiver's proof is recomputed: wrong tokens, a wrong parent, or a book hashed
    under another seed (a misconfigured cluster) cannot prove the page."""
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 2)
    page = incoming(sender, hashes, tokens, 1)
    own = tuple(tokens[PAGE:])
    wrong = (own[0] + 1, *own[1:])
    before = state(receiver)
    for proof in (PageProof(hashes[0], wrong), PageProof(hashes[1], own), PageProof(None, own)):
        with pytest.raises(HashMismatch, match="do not hash"):
            receiver.insert_many([page], ProofBook({hashes[1]: proof}))
    assert_unchanged(receiver, before)
    pool, store = receiver.pool, receiver.store
    foreign = PageService(pool, store, PageHasher(PAGE, seed="another-seed"))
    first = incoming(sender, hashes, tokens, 0)  # chained to the root, which the seed makes
    with pytest.raises(HashMismatch, match="another seed"):
        foreign.insert_many([first], book(receiver, tokens))
    assert_unchanged(receiver, before)


def test_what_a_sender_says_of_a_page_is_never_its_proof() -> None:
    """Token ids, parent and LoRA that travel with a page are the sender's word: a lie in them
    neither gets a page in nor keeps a provable one out, and the page is cached with the
    receiver's own tokens and parent."""
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 2)
    page = incoming(sender, hashes, tokens, 1)
    lying = dataclasses.replace(page, parent_hash=hashes[1], token_ids=(9,) * PAGE, lora_id=3)
    before = state(receiver)
    with pytest.raises(HashMismatch, match="refused without proof"):
        receiver.insert_many([page], NO_PROOFS)  # true claims, no proof of the receiver's own
    assert_unchanged(receiver, before)
    assert receiver.insert_many([lying], book(receiver, tokens)) == [True]
    (stored,) = [e for e in receiver.take_events() if isinstance(e, PagesStored)]
    assert (stored.parent_hash, stored.token_ids, stored.lora_id) == (
        hashes[0],
        tuple(tokens[PAGE:]),
        None,
    )


def test_corrupted_or_misshapen_pages_are_refused_and_change_nothing() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 1)
    page = incoming(sender, hashes, tokens, 0)
    proofs = book(receiver, tokens)
    flipped = bytearray(page.blob.data)
    flipped[3] ^= 0x80
    before = state(receiver)
    with pytest.raises(ChecksumMismatch):
        receiver.insert_many(
            [dataclasses.replace(page, blob=dataclasses.replace(page.blob, data=bytes(flipped)))],
            proofs,
        )
    half = make_service(dtype="float16")
    fill(half, 1)
    with half.pinned(hashes) as (pid,):
        assert pid is not None
        f16 = half.store.export_page(pid, copy=True)
    with pytest.raises(PageFormatError):
        receiver.insert_many([dataclasses.replace(page, blob=f16)], proofs)
    with pytest.raises(InvalidInput, match="page hash"):
        receiver.insert_many([dataclasses.replace(page, page_hash=PageHash(b""))], proofs)
    assert_unchanged(receiver, before)


def test_one_bad_page_in_a_batch_inserts_none_of_it() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 3)
    pages = [incoming(sender, hashes, tokens, i) for i in range(3)]
    pages[2] = dataclasses.replace(pages[2], blob=dataclasses.replace(pages[2].blob, checksum=0))
    before = state(receiver)
    with pytest.raises(ChecksumMismatch):
        receiver.insert_many(pages, book(receiver, tokens))
    assert_unchanged(receiver, before)


def test_a_full_pool_refuses_the_insert_and_changes_nothing() -> None:
    sender, receiver = make_service(), make_service(num_pages=4)
    hashes, tokens = fill(sender, 3)
    held = receiver.pool.get_new_pages(3)
    before = state(receiver)
    with pytest.raises(PoolExhausted):
        receiver.insert_many([incoming(sender, hashes, tokens, 0)], book(receiver, tokens))
    assert_unchanged(receiver, before)
    receiver.pool.free_pages(held)


def test_insert_evicts_the_least_recently_used_free_page_when_needed() -> None:
    sender, receiver = make_service(num_pages=32), make_service(num_pages=4)
    old, _ = fill(receiver, 3, start=50)
    hashes, tokens = fill(sender, 1)
    page = incoming(sender, hashes, tokens, 0)
    assert receiver.insert_many([page], book(receiver, tokens)) == [True]
    # fill() freed its pages tail-first, so the old prefix lost its tail, not its head.
    assert receiver.lookup(old) == [True, True, False]
    receiver.check_invariants()


def test_duplicates_within_one_batch_are_inserted_once() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 1)
    page = incoming(sender, hashes, tokens, 0)
    assert receiver.insert_many([page, page], book(receiver, tokens)) == [True, False]
    assert receiver.pool.get_num_free_pages() == receiver.pool.num_pages - 1
    assert len(receiver.pool.get_cached_pages(hashes[0])) == 1


def test_a_page_without_proof_is_refused_however_good_its_checksum() -> None:
    """Flipped by issue 12: a page that came without token ids (the salted first page) was
    cached on its checksum alone. Now it is refused unless the receiver's own book proves
    it; a book without the tenant's salt cannot, the one with it can."""
    sender, receiver = make_service(), make_service()
    salted = ExtraKeys(cache_salt="tenant-a")
    hashes, tokens = fill(sender, 2, keys=salted)
    page = dataclasses.replace(incoming(sender, hashes, tokens, 0), token_ids=())
    before = state(receiver)
    with pytest.raises(HashMismatch, match="refused without proof"):
        receiver.insert_many([page], NO_PROOFS)
    unsalted = ProofBook.for_pages(hashes, tokens, NO_EXTRA, PAGE)  # right tokens, no salt
    with pytest.raises(HashMismatch, match="do not hash"):
        receiver.insert_many([page], unsalted)
    assert_unchanged(receiver, before)
    assert receiver.insert_many([page], book(receiver, tokens, salted)) == [True]
    assert receiver.lookup(hashes) == [True, False]


def test_lora_pages_are_proven_with_the_lora_id_as_extra_key() -> None:
    sender, receiver = make_service(), make_service()
    lora = ExtraKeys(lora_id=7)
    hashes, tokens = fill(sender, 2, keys=lora)
    pages = [incoming(sender, hashes, tokens, i, lora=7) for i in range(2)]
    assert receiver.insert_many(pages, book(receiver, tokens, lora)) == [True, True]
    stored = [e for e in receiver.take_events() if isinstance(e, PagesStored)]
    assert [e.lora_id for e in stored] == [7, 7]  # the proof's LoRA, cached with the page
    other = make_service()
    with pytest.raises(HashMismatch):  # a book without the adapter cannot prove its pages
        other.insert_many(pages[:1], ProofBook.for_pages(hashes, tokens, NO_EXTRA, PAGE))
    assert other.pool.cached_hashes() == set()


def test_page_info_offers_tokens_only_when_they_prove_the_hash() -> None:
    service = make_service()
    plain, tokens = fill(service, 2)
    salted, _ = fill(service, 2, start=40, keys=ExtraKeys(cache_salt="s"))
    ids = service.pin([plain[1], salted[0], salted[1]])
    infos = [service.page_info(pid) for pid in ids if pid is not None]
    assert infos[0].token_ids == tuple(tokens[PAGE:]) and infos[0].parent_hash == plain[0]
    assert infos[1].token_ids == ()  # the salted first page cannot be proven
    assert len(infos[2].token_ids) == PAGE  # later pages chain from it: provable
    assert infos[0].tier == "gpu"  # the device pool's pages, on any torch device
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
    proofs = book(receiver, tokens)
    results: list[list[bool]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for page in pages:
                results.append(receiver.insert_many([page], proofs))
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
    assert receiver.insert(hashes[0], blob, book(receiver, tokens)) is True


def receive_in_place(
    receiver: PageService, res: Any, page: IncomingPage, proofs: ProofBook
) -> None:
    """What an in-place transport does: write the bytes into the reserved page, check them."""
    receiver.store.import_page(res.page_id, page.blob, verified=False)
    receiver.check(page, proofs)


def test_reserved_pages_are_cached_on_commit_bit_exact_and_evictable() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 3)
    proofs = book(receiver, tokens)
    reserved = receiver.reserve(hashes)
    assert all(r is not None for r in reserved)
    assert receiver.pool.cached_hashes() == set()  # held, not yet hit-able
    pages = [incoming(sender, hashes, tokens, i) for i in range(3)]
    for res, page in zip(reserved, pages, strict=True):
        assert res is not None
        receive_in_place(receiver, res, page, proofs)
    passed = [(r, p) for r, p in zip(reserved, pages, strict=True) if r]
    assert receiver.commit(passed, proofs) == [True] * 3
    assert receiver.lookup(hashes) == [True, True, True]
    assert receiver.ref_counts() == [0] * 16  # released: cached but evictable
    with receiver.pinned(hashes[:1]) as (pid,):
        assert pid is not None
        assert receiver.export(pid).data == pages[0].blob.data
    receiver.check_invariants()


def test_cached_repeated_and_in_flight_hashes_get_no_reservation() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 3)
    receiver.insert_many([incoming(sender, hashes, tokens, 0)], book(receiver, tokens))
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
    proofs = book(receiver, tokens)
    free_before = receiver.pool.get_num_free_pages()
    reserved = receiver.reserve(hashes)
    assert receiver.pool.get_num_free_pages() == free_before - 2
    good = incoming(sender, hashes, tokens, 0)
    ok, bad = reserved
    assert ok is not None and bad is not None
    receive_in_place(receiver, ok, good, proofs)
    assert receiver.commit([(ok, good)], proofs, failed=[bad]) == [True]
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
        receiver.commit([(res, incoming(sender, hashes, tokens, 1))], book(receiver, tokens))
    receiver.release([res])
    receiver.check_invariants()


def test_a_commit_the_book_cannot_prove_is_refused_whole_and_caches_nothing() -> None:
    """Bytes already in reserved pages are still refused without proof: nothing is cached,
    the reservations stay the caller's to release, and then the pool is as before."""
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 2)
    before = state(receiver)
    reserved = receiver.reserve(hashes)
    pages = [incoming(sender, hashes, tokens, i) for i in range(2)]
    passed = [(r, p) for r, p in zip(reserved, pages, strict=True) if r]
    half = ProofBook.for_pages(hashes[:1], tokens, NO_EXTRA, PAGE)  # proves the first only
    with pytest.raises(HashMismatch):
        receiver.commit(passed, half)
    assert receiver.pool.cached_hashes() == set()
    receiver.release([r for r, _ in passed])
    after = state(receiver)
    assert after[:3] == before[:3]  # the written bytes stay in free, uncached pages
    assert receiver.reserve(hashes[:1])[0] is not None  # not stuck "in flight"


# ------------------------------------------------------------------ receivers


def test_a_receiver_reserves_only_for_hashes_its_book_proves_and_evicts_nothing_else() -> None:
    """`PageReceiver.reserve` holds (and so evicts) pool pages only for provable hashes: a
    page that will be refused costs the pool nothing."""
    sender, receiver = make_service(), make_service(num_pages=6)
    own, _ = fill(receiver, 5, start=60)  # every usable page cached and evictable
    hashes, tokens = fill(sender, 3)
    before = state(receiver)
    nothing = receiver.receiving(NO_PROOFS)
    assert nothing.reserve(hashes) == [None, None, None]
    assert_unchanged(receiver, before)
    stranger = make_service().hasher.hash_prompt(tokens_for(1, start=200))[0]
    first = receiver.receiving(ProofBook.for_pages(hashes[:1], tokens, NO_EXTRA, PAGE))
    got = first.reserve([stranger, hashes[0], hashes[1]])
    assert [r is None for r in got] == [True, False, True]
    assert receiver.lookup(own) == [True] * 4 + [False]  # one page evicted, for hashes[0] only
    page = incoming(sender, hashes, tokens, 0)
    res = got[1]
    assert res is not None
    receiver.store.import_page(res.page_id, page.blob, verified=False)
    first.check(page)
    assert first.commit([(res, page)]) == [True]
    assert receiver.lookup(hashes) == [True, False, False]
    receiver.check_invariants()


def test_a_receiver_proves_every_insert_against_its_own_book() -> None:
    sender, receiver = make_service(), make_service()
    hashes, tokens = fill(sender, 3)
    pages = [incoming(sender, hashes, tokens, i) for i in range(3)]
    into = receiver.receiving(ProofBook.for_pages(hashes[:2], tokens, NO_EXTRA, PAGE))
    assert into.insert_many(pages[:2]) == [True, True]
    receiver.take_events()
    before = state(receiver)
    with pytest.raises(HashMismatch, match="refused without proof"):
        into.insert_many(pages[2:])
    assert_unchanged(receiver, before)
    assert into.store is receiver.store and into.pusher is None


def test_proof_books_need_the_tokens_of_every_page_they_prove() -> None:
    hashes, tokens = fill(make_service(), 2)
    with pytest.raises(InvalidInput, match="cannot prove 2 pages"):
        ProofBook.for_pages(hashes, tokens[:-1], NO_EXTRA, PAGE)
    later = ProofBook.for_pages(
        hashes[1:], tokens[PAGE:], NO_EXTRA, PAGE, first_page=1, parent=hashes[0]
    )
    proof = later.get(hashes[1])
    assert proof is not None and proof.parent_hash == hashes[0]
    assert later.hashes == (hashes[1],) and len(later) == 1 and hashes[0] not in later


# ------------------------------------------------------------------ push grants


def no_grant_refusals(name: str) -> float:
    value = REGISTRY.get_sample_value(
        "kvmesh_transfer_refused_total", {"worker": name, "reason": "no_grant"}
    )
    return value or 0.0


def test_a_push_ticket_admits_its_book_once() -> None:
    sender, receiver = make_service(), make_service(name="decode-0")
    hashes, tokens = fill(sender, 2)
    ticket = receiver.grants.grant(book(receiver, tokens))
    assert len(ticket) == 16 and len(receiver.grants) == 1
    into = receiver.receiving_push(ticket, "prefill-0")
    assert into.pusher == "prefill-0" and set(into.proofs.hashes) == set(hashes)
    assert len(receiver.grants) == 0  # consumed
    refused = no_grant_refusals("decode-0")
    with pytest.raises(PermissionDenied, match="unknown, used or expired"):
        receiver.receiving_push(ticket, "prefill-0")
    assert no_grant_refusals("decode-0") == refused + 1


@pytest.mark.parametrize(
    "ticket", [b"", b"\x00" * 16, b"not-a-ticket"], ids=["none", "zeros", "junk"]
)
def test_a_push_without_a_live_ticket_is_permission_denied(ticket: bytes) -> None:
    receiver = make_service(name="decode-1")
    receiver.grants.grant(book(receiver, tokens_for(2)))  # a grant exists, for another ticket
    refused = no_grant_refusals("decode-1")
    with pytest.raises(PermissionDenied, match=r"grant|ticket"):
        receiver.receiving_push(ticket, "prefill-0")
    assert no_grant_refusals("decode-1") == refused + 1
    assert len(receiver.grants) == 1  # a bad ticket consumes nobody else's


def test_a_push_ticket_expires_after_its_time_to_live() -> None:
    clock = Clock()
    receiver = make_service(grants=PushGrants(ttl_s=5.0, clock=clock))
    proofs = book(receiver, tokens_for(1))
    early, late = receiver.grants.grant(proofs), receiver.grants.grant(proofs)
    clock.now += 4.9
    assert receiver.grants.take(early) is proofs
    clock.now += 0.1
    with pytest.raises(PermissionDenied, match="expired"):
        receiver.grants.take(late)
    receiver.grants.grant(proofs)  # granting drops the expired ones
    assert len(receiver.grants) == 1


def test_open_grants_are_capped_and_the_oldest_goes_first() -> None:
    grants = PushGrants(max_grants=2)
    tickets = [grants.grant(NO_PROOFS) for _ in range(3)]
    assert len(grants) == 2
    with pytest.raises(PermissionDenied):
        grants.take(tickets[0])
    assert grants.take(tickets[1]) is NO_PROOFS and grants.take(tickets[2]) is NO_PROOFS
    for bad in ({"ttl_s": 0.0}, {"max_grants": 0}):
        with pytest.raises(InvalidInput, match="push grants need"):
            PushGrants(**bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ eviction budgets


def test_an_eviction_budget_refills_at_capacity_per_window_up_to_capacity() -> None:
    clock = Clock()
    budget = EvictionBudget(10, 20.0, clock=clock)  # 0.5 pages a second
    assert budget.available("a") == 10
    budget.spend("a", 7)
    assert (budget.available("a"), budget.available("b")) == (3, 10)  # per peer
    clock.now += 3.0  # +1.5
    assert budget.available("a") == 4  # 4.5 pages, whole pages only
    clock.now += 1.0  # +0.5
    assert budget.available("a") == 5
    budget.spend("a", 9)
    assert budget.available("a") == 0  # never below zero
    budget.spend("a", 0)
    clock.now += 1.9
    assert budget.available("a") == 0
    clock.now += 0.1
    assert budget.available("a") == 1
    clock.now += 1000.0
    assert budget.available("a") == 10  # never above capacity
    for bad in ((-1, 1.0), (1, 0.0)):
        with pytest.raises(InvalidInput, match="eviction budget needs"):
            EvictionBudget(*bad)


def test_pushed_pages_that_would_evict_more_than_the_budget_are_refused_and_evict_nothing() -> None:
    clock = Clock()
    sender = make_service()
    receiver = make_service(num_pages=6, evictions=EvictionBudget(2, 10.0, clock=clock))
    own, _ = fill(receiver, 5, start=60)  # every usable page cached and evictable
    hashes, tokens = fill(sender, 3)
    pages = [incoming(sender, hashes, tokens, i) for i in range(3)]
    proofs = book(receiver, tokens)
    push = receiver.receiving_push(receiver.grants.grant(proofs), "greedy")
    before = state(receiver)
    with pytest.raises(
        PoolExhausted, match="would evict 3 cached pages; pusher greedy may evict 2"
    ):
        push.insert_many(pages)
    assert push.reserve(hashes) == [None, None, None]  # the in-place path keeps the same cap
    assert_unchanged(receiver, before)
    assert receiver.evictions.available("greedy") == 2  # a refusal costs nothing
    assert push.insert_many(pages[:2]) == [True, True]
    assert receiver.lookup(own).count(True) == 3 and receiver.evictions.available("greedy") == 0
    with pytest.raises(PoolExhausted, match="may evict 0 more"):
        push.insert_many(pages[2:])
    assert receiver.evictions.available("someone-else") == 2  # budgets are per pusher
    clock.now += 5.0  # half a window: one page back
    assert push.insert_many(pages[2:]) == [True]
    assert receiver.lookup(hashes) == [True] * 3 and receiver.lookup(own).count(True) == 2
    receiver.check_invariants()


def test_only_pushes_are_charged_and_only_for_the_cached_pages_they_evict() -> None:
    sender = make_service()
    hashes, tokens = fill(sender, 3)
    pages = [incoming(sender, hashes, tokens, i) for i in range(3)]
    empty = make_service(num_pages=6, evictions=EvictionBudget(0, 10.0))
    push = empty.receiving_push(empty.grants.grant(book(empty, tokens)), "prefill-0")
    assert push.insert_many(pages) == [True] * 3  # free, uncached pages: nothing evicted
    full = make_service(num_pages=6, evictions=EvictionBudget(0, 10.0))
    fill(full, 5, start=60)
    assert full.receiving(book(full, tokens)).insert_many(pages) == [True] * 3  # a pull
    assert full.evictions.available("prefill-0") == 0
