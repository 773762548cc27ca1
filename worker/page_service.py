"""The worker-side facade the transports use: look up, pin, export and insert pages.

It joins the page pool (which pages are cached, reference counts) and the KV
store (the bytes) behind one lock, so gRPC handlers, the torch.distributed
path and the worker's own request loop can share a pool that is itself not
thread-safe. It imports neither gRPC nor Ray.

Streaming a page out::

    ids = service.pin(hashes)        # ref +1: cannot be evicted or reused
    try:   ... service.export(id) ...
    finally: service.unpin(ids)      # ref -1: back to the free queue (cached)

Taking a page in (`insert_many`): checked first (dtype, shape, size,
checksum, and the proof of its hash), then a page is allocated, the bytes are
written outside the lock, and the page is cached and freed, so it stays
cached but evictable. A page already held is skipped, never overwritten. A
refused page changes nothing.

Trust: every page proves its hash before it is cached, whatever brought it.
The proof is the receiver's own (`ProofBook`, in `kvmesh.worker.page_proofs`):
the tokens and extra keys (LoRA, salt, media) of the request it is serving,
from which it recomputes
``hash(parent, tokens, extra) == page_hash``. What a sender says about a page
(its parent, tokens, LoRA) is never taken as proof, so a peer cannot cache
bytes under a hash the receiver did not ask for, and salted and multimodal
pages prove like any other (the receiver knows its request's salt and media).
A pull builds its book from the request it serves; a push is taken only
against a grant (`grants.grant`): the receiving worker made the book from
the request routed to it and handed the pusher a one-use ticket.

Receiving in place (`reserve` / `commit` / `release`): a transport that
writes bytes straight into the KV store (torch.distributed) holds uncached
pages for them, checks the bytes where they landed with `check`, and only
then caches them; a page being received is "in flight" and never reserved
or inserted twice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from kvmesh.errors import HashMismatch, InvalidInput, PermissionDenied, PoolExhausted
from kvmesh.events import KVEvent
from kvmesh.hashing import PageHasher
from kvmesh.metrics import TRANSFER_REFUSED
from kvmesh.types import PageHash, PageId
from kvmesh.worker.cache_manager import PagePromoter
from kvmesh.worker.free_queue import KVPage
from kvmesh.worker.kv_store import KVStore, PageBlob
from kvmesh.worker.page_pool import PagePool
from kvmesh.worker.page_proofs import NO_PROOFS, EvictionBudget, PageProof, ProofBook, PushGrants
from kvmesh.worker.page_tokens import PageTokens

MAX_HASH_BYTES = 64


@dataclass(frozen=True, slots=True)
class IncomingPage:
    """A page offered to `PageService.insert_many`, as its sender describes it.

    `parent_hash`, `token_ids` and `lora_id` are the sender's word (kept on the
    wire for senders and tools); the receiver proves the page with its own
    `ProofBook` and caches it with the proof's values.
    """

    page_hash: PageHash
    parent_hash: PageHash | None
    token_ids: tuple[int, ...]
    blob: PageBlob
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class Reservation:
    """A pool page held for one incoming page's bytes (`PageService.reserve`)."""

    page: KVPage
    page_hash: PageHash

    @property
    def page_id(self) -> PageId:
        return self.page.page_id


@dataclass(frozen=True, slots=True)
class PageInfo:
    """What a sender says about a pinned page besides its bytes.

    `token_ids` is empty unless they are known and provably hash to `page_hash`.
    """

    page_id: PageId
    page_hash: PageHash
    parent_hash: PageHash | None
    token_ids: tuple[int, ...]
    lora_id: int | None
    tier: str


def check_hash(page_hash: bytes, what: str = "page hash") -> PageHash:
    """A page hash from the wire: 1 to 64 bytes."""
    if not isinstance(page_hash, bytes) or not 0 < len(page_hash) <= MAX_HASH_BYTES:
        size = len(page_hash) if isinstance(page_hash, bytes) else type(page_hash).__name__
        raise InvalidInput(f"{what} must be 1-{MAX_HASH_BYTES} bytes, got {size}")
    return PageHash(page_hash)


class PageService:
    """Thread-safe page lookup / pin / export / insert over one pool and store.

    Every pool call happens under `lock` (pass the worker's own lock to share
    it with the cache manager). Byte copies happen outside it: an allocated
    page is private to the inserting thread until it is cached.
    """

    __slots__ = (
        "_inflight",
        "_lock",
        "_tokens",
        "evictions",
        "grants",
        "hasher",
        "name",
        "pool",
        "store",
        "tiers",
    )

    def __init__(
        self,
        pool: PagePool,
        store: KVStore,
        hasher: PageHasher,
        *,
        lock: AbstractContextManager[object] | None = None,
        grants: PushGrants | None = None,
        evictions: EvictionBudget | None = None,
        name: str = "",
    ) -> None:
        if store.num_pages != pool.num_pages:
            raise InvalidInput(
                f"KV store has {store.num_pages} pages but the pool {pool.num_pages}; "
                "build both from the same PoolConfig"
            )
        if hasher.page_size != pool.page_size or store.page_shape[2] != pool.page_size:
            raise InvalidInput(
                f"page sizes disagree: hasher {hasher.page_size}, pool {pool.page_size}, "
                f"store {store.page_shape[2]}"
            )
        self.pool = pool
        self.store = store
        self.hasher = hasher
        self._lock: AbstractContextManager[object] = lock if lock is not None else threading.Lock()
        self._inflight: set[PageHash] = set()
        self.grants = grants if grants is not None else PushGrants()
        self.evictions = (
            evictions if evictions is not None else EvictionBudget(pool.num_pages // 2, 10.0)
        )
        self.name = name  # the worker's id, for metrics
        # lower tiers under the pool (kvmesh.worker.tiered_cache): `pin` promotes from them
        # first, so peers pull pages this worker keeps in host memory or on disk
        self.tiers: PagePromoter | None = None
        self._tokens = PageTokens(hasher, pool.num_pages)

    @property
    def lock(self) -> AbstractContextManager[object]:
        return self._lock

    # ------------------------------------------------------------------ lookups

    def lookup(self, hashes: Sequence[PageHash]) -> list[bool]:
        """For each hash, whether a page is cached under it (no ref counts change)."""
        with self._lock:
            get = self.pool.get_cached_page
            return [get(h) is not None for h in hashes]

    def prefix_length(self, hashes: Sequence[PageHash]) -> int:
        """How many leading `hashes` are cached (stops at the first miss)."""
        with self._lock:
            get = self.pool.get_cached_page
            n = 0
            for h in hashes:
                if get(h) is None:
                    break
                n += 1
            return n

    # ---------------------------------------------------------------- pinning

    def pin(self, hashes: Sequence[PageHash]) -> list[PageId | None]:
        """Take a reference on each cached page (a hit); None for a miss.

        Pinned pages are neither evicted nor reused until `unpin`. A hash
        asked twice is pinned twice (unpin the returned list as it is).
        """
        if self.tiers is not None:  # disk reads happen before the lock
            self.tiers.prefetch(hashes, len(hashes))
        with self._lock:
            if self.tiers is not None:
                self.tiers.promote(hashes, len(hashes))
            get = self.pool.get_cached_page
            found = [get(h) for h in hashes]
            hits = [p for p in found if p is not None]
            self.pool.touch(hits)
        return [None if p is None else p.page_id for p in found]

    def unpin(self, page_ids: Iterable[PageId | None]) -> None:
        """Drop the references `pin` took (Nones are ignored).

        Pages are released last-first, so a prefix's tail is evicted before its head.
        """
        ids = [pid for pid in page_ids if pid is not None]
        if not ids:
            return
        with self._lock:
            pages = self.pool.pages
            self.pool.free_pages([pages[pid] for pid in reversed(ids)])

    def pinned(self, hashes: Sequence[PageHash]) -> _Pinned:
        """``with service.pinned(hashes) as ids:`` pins for the block, unpins on any exit."""
        return _Pinned(self, hashes)

    # ---------------------------------------------------------------- export

    def export(self, page_id: PageId) -> PageBlob:
        """The bytes of a page the caller has pinned (a zero-copy view on CPU).

        The view stays valid while the pin is held: a cached page is never written.
        """
        return self.store.export_page(page_id)

    def page_info(self, page_id: PageId) -> PageInfo:
        """Hash, parent, provable token ids and LoRA of a pinned page."""
        with self._lock:
            page = self.pool.pages[page_id]
            key, parent, lora = page.page_hash, page.parent_hash, page.lora_id
            tokens = self._tokens.get(key) if key is not None else None
            held = page.ref_cnt > 0
        if key is None or not held:
            raise InvalidInput(f"page {page_id} is not a pinned cached page; pin it first")
        tokens = self._tokens.provable(key, parent, tokens, lora)
        return PageInfo(page_id, key, parent, tokens, lora, self.pool.medium)

    # ---------------------------------------------------------------- insert

    def prove(self, page_hash: PageHash, proofs: ProofBook) -> PageProof:
        """The receiver's proof of `page_hash`; `HashMismatch` when it has none or it fails.

        One hash of the page's tokens and extra keys: the book was built from
        the request being served, and the recomputation catches a book whose
        hashes came from elsewhere (another seed, another algorithm).
        """
        proof = proofs.get(page_hash)
        if proof is None:
            TRANSFER_REFUSED.labels(worker=self.name, reason="no_proof").inc()
            raise HashMismatch(
                f"page {page_hash.hex()[:16]} is not a page of a request this worker serves "
                "or granted a push for; refused without proof of its hash"
            )
        if not self._holds(page_hash, proof):
            TRANSFER_REFUSED.labels(worker=self.name, reason="hash_proof").inc()
            raise HashMismatch(
                f"page {page_hash.hex()[:16]}: the request's {len(proof.token_ids)} tokens "
                f"(parent {proof.parent_hash.hex()[:16] if proof.parent_hash else 'root'}) do "
                f"not hash to it under this cluster's seed and {self.hasher.algo}; the request "
                "was hashed with another seed or hash function"
            )
        return proof

    def proves(self, page_hash: PageHash, proofs: ProofBook) -> bool:
        """Whether `proofs` proves `page_hash` (like `prove`, without raising or counting)."""
        proof = proofs.get(page_hash)
        return proof is not None and self._holds(page_hash, proof)

    def _holds(self, page_hash: PageHash, proof: PageProof) -> bool:
        try:
            got = self.hasher.hash_page(proof.parent_hash, proof.token_ids, proof.extra)
        except InvalidInput:
            return False
        return got == page_hash

    def check(
        self, page: IncomingPage, proofs: ProofBook, *, with_checksum: bool = True
    ) -> PageProof:
        """Raise unless `page` may enter the pool: format, checksum, proof of its hash.

        `PageFormatError` / `ChecksumMismatch` from the store; `HashMismatch`
        when `proofs` cannot prove the page's hash. Returns the proof, whose
        parent, tokens and LoRA the page is cached with.
        `with_checksum=False`: all but the checksum, before the bytes arrive.
        """
        check_hash(page.page_hash)
        if page.parent_hash is not None:
            check_hash(page.parent_hash, "parent hash")
        proof = self.prove(page.page_hash, proofs)
        self.store.check_blob(page.blob, with_checksum=with_checksum)
        return proof

    def insert(self, page_hash: PageHash, blob: PageBlob, proofs: ProofBook) -> bool:
        """Check and cache one page; False when it is already held (nothing written).

        Raises the check's error, or `PoolExhausted` when every page is held;
        in either case nothing changed.
        """
        return self.insert_many([IncomingPage(page_hash, None, (), blob)], proofs)[0]

    def insert_many(
        self,
        pages: Sequence[IncomingPage],
        proofs: ProofBook,
        *,
        pusher: str | None = None,
    ) -> list[bool]:
        """Check every page, then cache the new ones; per page: True inserted, False skipped.

        All or nothing: one bad page, too few free pages for the new ones, or,
        for pages pushed by `pusher`, more cached pages to evict than its
        `evictions` budget allows, raises before anything is written. Pages are cached in the given order
        (parents first) with their proofs' parents, tokens and LoRA, and
        released tail-first.
        """
        checked = [self.check(page, proofs) for page in pages]
        with self._lock:
            get = self.pool.get_cached_page
            seen: set[PageHash] = set()
            todo: list[int] = []
            for i, page in enumerate(pages):
                key = page.page_hash
                if key in seen or key in self._inflight or get(key) is not None:
                    continue
                seen.add(key)
                todo.append(i)
            if pusher is not None:
                evicting = self.pool.evictions_for(len(todo))
                allowed = self.evictions.available(pusher)
                if evicting > allowed:
                    TRANSFER_REFUSED.labels(worker=self.name, reason="evict_cap").inc()
                    raise PoolExhausted(
                        f"taking {len(todo)} pushed pages would evict {evicting} cached pages; "
                        f"pusher {pusher} may evict {allowed} more now (TransferConfig."
                        "push_evict_fraction of the pool per push_evict_window_s); retry later"
                    )
            slots = self.pool.get_new_pages(len(todo))  # PoolExhausted: nothing changed
            if pusher is not None:
                self.evictions.spend(pusher, evicting)
            self._inflight.update(seen)
        try:
            for i, slot in zip(todo, slots, strict=True):
                self.store.import_page(slot.page_id, pages[i].blob, verified=True)
        except BaseException:
            with self._lock:
                self._inflight.difference_update(seen)
                self.pool.free_pages(reversed(slots))
            raise
        with self._lock:
            self._inflight.difference_update(seen)
            for i, slot in zip(todo, slots, strict=True):
                key, proof = pages[i].page_hash, checked[i]
                self.pool.cache_page(slot, key, proof.parent_hash, proof.token_ids, proof.lora_id)
                self._tokens.remember(key, proof.token_ids)
            self.pool.free_pages(reversed(slots))
        inserted = [False] * len(pages)
        for i in todo:
            inserted[i] = True
        return inserted

    # ---------------------------------------------------------------- in-place receive

    def reserve(
        self, hashes: Sequence[PageHash], *, pusher: str | None = None
    ) -> list[Reservation | None]:
        """Held, uncached pool pages for transports that write received bytes straight
        into the KV store (torch.distributed), one per hash that needs one.

        None where the hash is cached already, being received by another
        transfer, or repeated in `hashes` (receive those into a buffer and
        `insert` them: that reports them held); all None when the pool has no
        room for every one, or, for `pusher`'s pages, when taking them would
        evict more than its budget. Every reservation must end in `commit` or
        `release`.
        """
        with self._lock:
            get = self.pool.get_cached_page
            need: list[int] = []
            keys: set[PageHash] = set()
            for i, h in enumerate(hashes):
                if h in keys or h in self._inflight or get(h) is not None:
                    continue
                keys.add(h)
                need.append(i)
            evicting = self.pool.evictions_for(len(need)) if pusher is not None else 0
            if pusher is not None and evicting > self.evictions.available(pusher):
                return [None] * len(hashes)
            try:
                fresh = self.pool.get_new_pages(len(need))
            except PoolExhausted:
                return [None] * len(hashes)
            if pusher is not None:
                self.evictions.spend(pusher, evicting)
            self._inflight.update(keys)
        out: list[Reservation | None] = [None] * len(hashes)
        for i, page in zip(need, fresh, strict=True):
            out[i] = Reservation(page, hashes[i])
        return out

    def commit(
        self,
        passed: Sequence[tuple[Reservation, IncomingPage]],
        proofs: ProofBook,
        failed: Sequence[Reservation] = (),
    ) -> list[bool]:
        """Cache reserved pages whose bytes are in the KV store and passed `check`; release
        all of them (cached ones stay cached, evictable) and `failed` ones too.

        Per passed page: True cached, False already cached by someone else
        meanwhile (its reserved page is simply released). Raises `InvalidInput`
        or `HashMismatch`, changing nothing, when a page does not match its
        reservation's hash or `proofs` cannot prove it.
        """
        proven: list[PageProof] = []
        for res, page in passed:  # refuse before anything changes
            if page.page_hash != res.page_hash:
                raise InvalidInput(
                    f"page {page.page_hash.hex()[:16]} committed into the page reserved "
                    f"for {res.page_hash.hex()[:16]}"
                )
            proven.append(self.prove(page.page_hash, proofs))
        cached = [False] * len(passed)
        with self._lock:
            for n, ((res, page), proof) in enumerate(zip(passed, proven, strict=True)):
                key = page.page_hash
                if self.pool.get_cached_page(key) is not None:
                    continue
                self.pool.cache_page(
                    res.page, key, proof.parent_hash, proof.token_ids, proof.lora_id
                )
                self._tokens.remember(key, proof.token_ids)
                cached[n] = True
            self._release_locked([*(res for res, _ in passed), *failed])
        return cached

    def release(self, reservations: Sequence[Reservation]) -> None:
        """Give reserved pages back uncommitted (a transfer failed before they were checked)."""
        with self._lock:
            self._release_locked(reservations)

    def receiving(self, proofs: ProofBook) -> PageReceiver:
        """A view of this service for one transfer whose pages `proofs` proves."""
        return PageReceiver(self, proofs)

    def receiving_push(self, ticket: bytes, pusher: str) -> PageReceiver:
        """The receiver for a push from `pusher` presenting `ticket` (consumed), within the
        pusher's eviction budget; `PermissionDenied` without a live grant, counted."""
        try:
            return PageReceiver(self, self.grants.take(ticket), pusher)
        except PermissionDenied:
            TRANSFER_REFUSED.labels(worker=self.name, reason="no_grant").inc()
            raise

    def _release_locked(self, reservations: Sequence[Reservation]) -> None:
        self._inflight.difference_update(r.page_hash for r in reservations)
        self.pool.free_pages(reversed([r.page for r in reservations]))

    # ---------------------------------------------------------------- events

    def take_events(self) -> list[KVEvent]:
        """Drain the pool's events (atomically) and learn cached pages' token ids from them."""
        with self._lock:
            events = self.pool.take_events()
            self._observe(events)
        return events

    def observe(self, events: Iterable[KVEvent]) -> None:
        """Learn token ids from events drained elsewhere (e.g. by the cache manager)."""
        with self._lock:
            self._observe(events)

    def _observe(self, events: Iterable[KVEvent]) -> None:
        self._tokens.learn(events, self.pool.cached_hashes)

    # ------------------------------------------------------------- inspection

    def ref_counts(self) -> list[int]:
        """Every page's reference count (for tests and invariant checks)."""
        with self._lock:
            return [p.ref_cnt for p in self.pool.pages]

    def check_invariants(self) -> None:
        """The pool's invariants, checked under the lock."""
        with self._lock:
            self.pool.check_invariants()


class PageReceiver:
    """Pages coming into one pool for one transfer, each proven against one `ProofBook`.

    What transports hold while they receive: the same calls as `PageService`
    with the proofs bound, so no receive path can cache a page unproven.
    `reserve` holds pool pages only for hashes the book can prove, so pages
    that will be refused never evict anything.
    """

    __slots__ = ("proofs", "pusher", "service")

    def __init__(
        self, service: PageService, proofs: ProofBook, pusher: str | None = None
    ) -> None:
        self.service = service
        self.proofs = proofs
        self.pusher = pusher  # set for pushes: evictions are charged to its budget

    @property
    def store(self) -> KVStore:
        return self.service.store

    def check(self, page: IncomingPage, *, with_checksum: bool = True) -> PageProof:
        return self.service.check(page, self.proofs, with_checksum=with_checksum)

    def insert_many(self, pages: Sequence[IncomingPage]) -> list[bool]:
        return self.service.insert_many(pages, self.proofs, pusher=self.pusher)

    def reserve(self, hashes: Sequence[PageHash]) -> list[Reservation | None]:
        provable = [h if self.service.proves(h, self.proofs) else None for h in hashes]
        asked = [h for h in provable if h is not None]
        got = iter(self.service.reserve(asked, pusher=self.pusher)) if asked else iter(())
        return [None if h is None else next(got) for h in provable]

    def commit(
        self,
        passed: Sequence[tuple[Reservation, IncomingPage]],
        failed: Sequence[Reservation] = (),
    ) -> list[bool]:
        return self.service.commit(passed, self.proofs, failed)

    def release(self, reservations: Sequence[Reservation]) -> None:
        self.service.release(reservations)


@dataclass(frozen=True, slots=True)
class PullOutcome:
    """How one pull into a pool went, whatever carried it (`kvmesh.worker.peers`).

    The pages arrived through a `PageReceiver`, so every page cached is
    whole, checked and proven; the puller takes from its pool those of
    `page_hashes` it now holds. `transport` names what delivered (after any
    fallback), `inserted` the pages newly cached. `error`: the pull failed
    part-way (the pages cached before it still count); `fallback_reason`: why
    the configured transport was left for another.
    """

    page_hashes: tuple[PageHash, ...]
    transport: str
    inserted: int = 0
    error: str | None = None
    fallback_reason: str | None = None


class _Pinned:
    __slots__ = ("_hashes", "_ids", "_service")

    def __init__(self, service: PageService, hashes: Sequence[PageHash]) -> None:
        self._service = service
        self._hashes = hashes
        self._ids: list[PageId | None] = []

    def __enter__(self) -> list[PageId | None]:
        self._ids = self._service.pin(self._hashes)
        return self._ids

    def __exit__(self, *exc: object) -> None:
        self._service.unpin(self._ids)


__all__ = [
    "MAX_HASH_BYTES",
    "NO_PROOFS",
    "EvictionBudget",
    "IncomingPage",
    "PageInfo",
    "PageProof",
    "PageReceiver",
    "PageService",
    "ProofBook",
    "PullOutcome",
    "PushGrants",
    "Reservation",
    "check_hash",
]
