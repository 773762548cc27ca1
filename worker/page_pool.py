"""The worker's page pool: fixed pages, reference counts, LRU prefix cache.

Semantics of vLLM v1's block pool (and EasyDeL eSurge's page pool):

- `num_pages` pages; page 0 is the null page (a placeholder for pages a
  sliding window skipped), never handed out, freed or cached;
- a page is either held (``ref_cnt > 0``) or in the free queue
  (``ref_cnt == 0``), never both;
- a full, computed page is cached under its hash; when its count drops to 0
  it goes back to the free queue *with* its hash, so it can still be hit
  (`touch` takes it out again) until it reaches the queue's head and is reused,
  which is when its hash is evicted;
- ``hash -> pages`` tolerates duplicates (two requests that computed the same
  prefix at once each cache their own copy).

Every change of the cached *set of hashes* is a KV event: `PagesStored` when a
hash gains its first page, `PagesRemoved` when it loses its last, and
`AllPagesCleared` on reset. A second copy of a cached hash changes nothing a
consumer can see, so it emits nothing (unlike vLLM, whose consumers must count
copies); replaying the events into a set always gives `cached_hashes()`.

`PagesStored` carries the pages' token ids when the caller passes them and
`event_token_ids` is on (the default; the page service learns from them which
tokens prove an exported page's hash). Copying them is the largest cost of
caching a page (512 token ids per page in `kvmesh bench pool`), and the
coordinator's index never reads them, so a pool whose events only feed the
index can turn them off.

Tiers and tenants (both optional, see `kvmesh.worker.tiered_cache`): every
cached page counts against a tenant (`tenant_of` its cache salt; `tenant_pages`);
an `eviction` policy (`kvmesh.worker.tenant_share`) may choose which free pages
`get_new_pages` reuses instead of the queue's head (with a policy the pool also
queues its free pages per tenant, in the free queue's order, so a fair choice
takes each tenant's oldest and reorders nothing), and a `spill_listener` is
handed each evicted hash's last page (its id and `PageMeta`) before the caller
can overwrite it, so that the host tier can copy it out. `record` lets the tiers
put their events into the same ordered stream.

Not thread-safe: the owner (the worker) holds a lock around every call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvmesh.config import PoolConfig
from kvmesh.errors import ConfigError, InvalidInput, InvariantViolation, PagesInUse, PoolExhausted
from kvmesh.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from kvmesh.tenants import DEFAULT_TENANT
from kvmesh.types import PageHash, PageId
from kvmesh.worker.free_queue import FreePageQueue, KVPage
from kvmesh.worker.tenant_share import EvictionPolicy, QueuedCandidates, TenantQueues

_CacheEntry = KVPage | dict[PageId, KVPage]
"""One page (the common case, no dict allocated) or several copies by page id."""


@dataclass(frozen=True, slots=True)
class PageMeta:
    """What a tier keeps beside a page's bytes: its identity and the tenant it counts against."""

    page_hash: PageHash
    parent_hash: PageHash | None
    lora_id: int | None
    tenant: str


def wire_tenant(tenant: str) -> str | None:
    """A tenant as events carry it: nil for the default tenant (as before tenants existed)."""
    return None if tenant == DEFAULT_TENANT else tenant


SpillListener = Callable[[list[tuple[PageId, PageMeta]]], None]
"""Called by `get_new_pages` with the evicted hashes' last pages, before anyone writes them."""


class PagePool:
    """Fixed pool of KV pages with reference counts and an LRU prefix cache.

    Costs: `get_cached_page` O(1); `get_new_pages`, `touch`, `free_pages`,
    `cache_full_pages` O(pages passed); `check_invariants`, `reset_prefix_cache`
    O(num_pages).
    """

    __slots__ = (
        "_cached",
        "_events",
        "_eviction",
        "_free_queues",
        "enable_caching",
        "event_token_ids",
        "free_queue",
        "medium",
        "null_page",
        "num_pages",
        "page_size",
        "page_tenants",
        "pages",
        "snapshot_hook",
        "spill_listener",
        "tenant_pages",
    )

    def __init__(
        self,
        num_pages: int,
        *,
        enable_caching: bool = True,
        medium: str = "gpu",
        page_size: int = 16,
        event_token_ids: bool = True,
    ) -> None:
        if num_pages < 2:
            raise ConfigError(
                f"num_pages must be at least 2 (page 0 is the null page), got {num_pages}"
            )
        if page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self.medium = medium
        self.page_size = page_size
        self.event_token_ids = event_token_ids
        self.pages: list[KVPage] = [KVPage(PageId(i)) for i in range(num_pages)]
        self.null_page = self.pages[0]
        self.null_page.is_null = True
        self.free_queue = FreePageQueue(self.pages[1:])
        self._cached: dict[PageHash, _CacheEntry] = {}
        self._events: list[KVEvent] = []
        # the tenant of each cached page (by page id) and the count per tenant
        self.page_tenants: list[str | None] = [None] * num_pages
        self.tenant_pages: Counter[str] = Counter()
        self._eviction: EvictionPolicy | None = None  # None: the free queue's head (LRU)
        # with a policy: the free pages per tenant (None: no cached data), in queue order
        self._free_queues: TenantQueues[KVPage] | None = None
        self.spill_listener: SpillListener | None = None
        # tiers below answer snapshots for the whole worker (their pages and the device's)
        self.snapshot_hook: Callable[[], list[PagesStored]] | None = None

    @classmethod
    def from_config(cls, cfg: PoolConfig, page_size: int) -> PagePool:
        return cls(
            cfg.num_pages,
            enable_caching=cfg.enable_caching,
            medium=cfg.medium,
            page_size=page_size,
            event_token_ids=cfg.event_token_ids,
        )

    # ------------------------------------------------------------------ lookups

    def get_cached_page(self, page_hash: PageHash) -> KVPage | None:
        """A page cached under `page_hash` (any copy), or None on a miss."""
        entry = self._cached.get(page_hash)
        if entry is None or type(entry) is KVPage:
            return entry
        return next(iter(entry.values()))  # type: ignore[union-attr]

    def match_prefix(self, page_hashes: Sequence[PageHash], max_pages: int) -> list[KVPage]:
        """The cached pages of the longest prefix of `page_hashes`, at most `max_pages`.

        One dict lookup per page up to the first miss; nothing is touched.
        """
        get = self._cached.get
        out: list[KVPage] = []
        push = out.append
        for i in range(min(max_pages, len(page_hashes))):
            entry = get(page_hashes[i])
            if entry is None:
                break
            if type(entry) is not KVPage:
                entry = next(iter(entry.values()))  # type: ignore[union-attr]
            push(entry)
        return out

    def get_cached_pages(self, page_hash: PageHash) -> list[KVPage]:
        """Every copy cached under `page_hash` (empty on a miss)."""
        entry = self._cached.get(page_hash)
        if entry is None:
            return []
        if type(entry) is KVPage:
            return [entry]
        return list(entry.values())  # type: ignore[union-attr]

    def cached_hashes(self) -> set[PageHash]:
        """The set of hashes the pool can hit right now."""
        return set(self._cached)

    def num_cached_hashes(self) -> int:
        return len(self._cached)

    def get_num_free_pages(self) -> int:
        """Pages `get_new_pages` can hand out now (free, cached or not)."""
        return self.free_queue.num_free_pages

    def evictions_for(self, n: int, tenant: str | None = None) -> int:
        """How many cached pages `get_new_pages(n, tenant)` would evict now: those of the
        very pages it would take, under the `eviction` policy too. O(n) (a fair choice:
        O(n log tenants)); changes nothing."""
        if n <= 0:
            return 0
        if self._uses_policy(tenant):
            victims = self._choose(min(n, self.free_queue.num_free_pages), tenant)
            return sum(p.page_hash is not None for p in victims)
        return self.free_queue.count_cached_in_head(n)

    @property
    def eviction(self) -> EvictionPolicy | None:
        """Which free pages `get_new_pages` reuses: None, the free queue's head (LRU)."""
        return self._eviction

    @eviction.setter
    def eviction(self, policy: EvictionPolicy | None) -> None:
        self._eviction = policy
        self._free_queues = None
        if policy is not None:
            self._requeue()

    def _requeue(self) -> None:
        """Queue the free pages per tenant anew, in the free queue's order; O(free pages)."""
        queues: TenantQueues[KVPage] = TenantQueues()
        queues.push_n(self._with_tenants(self.free_queue.get_all_free_pages()))
        self._free_queues = queues

    def _tenant_of_free(self, page: KVPage) -> str | None:
        """The tenant a free page's data counts against (None: it holds no cached data)."""
        if page.page_hash is None:
            return None
        return self.page_tenants[page.page_id] or DEFAULT_TENANT

    def _with_tenants(self, pages: list[KVPage]) -> list[tuple[KVPage, str | None]]:
        """Free pages with `_tenant_of_free` each, in one pass."""
        tenants = self.page_tenants
        return [
            (p, None if p.page_hash is None else tenants[p.page_id] or DEFAULT_TENANT)
            for p in pages
        ]

    def _uses_policy(self, tenant: str | None) -> bool:
        """Whether `get_new_pages` asks the policy: when pages of a tenant other than the
        requester's are cached (one tenant alone evicts its oldest, as plain LRU)."""
        return (
            self._eviction is not None
            and bool(self.tenant_pages)
            and (len(self.tenant_pages) > 1 or tenant not in self.tenant_pages)
        )

    def _choose(self, n: int, tenant: str | None) -> list[KVPage]:
        """The `n` free pages the policy would reuse for `tenant` (nothing moved)."""
        if self._eviction is None or self._free_queues is None:
            raise InvariantViolation("the pool has no eviction policy to choose with")
        return self._eviction.choose(
            QueuedCandidates(self._oldest_free, self._free_queues),
            self.tenant_pages,
            self.num_pages - 1,
            n,
            tenant,
        )

    @property
    def usage(self) -> float:
        """Fraction of the non-null pages that are held (0.0 idle, 1.0 full)."""
        return 1.0 - self.free_queue.num_free_pages / (self.num_pages - 1)

    # --------------------------------------------------------------- allocation

    def get_new_pages(self, n: int, tenant: str | None = None) -> list[KVPage]:
        """Hand out `n` pages (ref count 1) from the head of the free queue.

        With an `eviction` policy and several tenants cached, the policy picks
        which free pages are reused instead (each tenant's oldest, for `tenant`;
        the others keep their places). A reused
        page loses its old hash first (one `PagesRemoved` per tenant losing hashes; the
        `spill_listener` sees the last copies before). Raises `PoolExhausted` when
        fewer than `n` pages are free, and then changes nothing.
        """
        if n > self.free_queue.num_free_pages or n < 0:
            if n < 0:
                raise InvalidInput(f"cannot allocate {n} pages")
            raise PoolExhausted(
                f"asked for {n} pages but only {self.free_queue.num_free_pages} of "
                f"{self.num_pages - 1} are free; free requests or grow the pool"
            )
        if self._uses_policy(tenant):
            pages = self._choose(n, tenant)
            if len(pages) != n or len(set(pages)) != n:
                raise InvariantViolation(
                    f"eviction policy chose {len(set(pages))} distinct of {n} pages among "
                    f"{self.free_queue.num_free_pages} free"
                )
            self.free_queue.remove_n(pages)
        else:
            pages = self.free_queue.popleft_n(n)
        queues = self._free_queues
        if queues is not None:
            queues.remove_n(self._with_tenants(pages))
        if len(self.tenant_pages) > 1:
            self._reuse(pages)
            return pages
        # One tenant holds every cached page (the common case): no per-page owner lookups.
        owner = next(iter(self.tenant_pages), DEFAULT_TENANT)
        removed: list[PageHash] | None = None
        spilled: list[tuple[PageId, PageMeta]] | None = None
        listener = self.spill_listener
        cached = self._cached
        lost = 0
        for page in pages:
            page.ref_cnt = 1
            key = page.page_hash
            if key is not None:
                lost += 1
                entry = cached.get(key)
                if entry is page:
                    del cached[key]
                    if listener is not None:
                        meta = PageMeta(key, page.parent_hash, page.lora_id, owner)
                        if spilled is None:
                            spilled = [(page.page_id, meta)]
                        else:
                            spilled.append((page.page_id, meta))
                    if removed is None:
                        removed = [key]
                    else:
                        removed.append(key)
                    page.page_hash = page.parent_hash = None
                else:
                    page.page_hash = page.parent_hash = None
                    self._drop_copy(key, entry, page)
        if lost:
            self._uncount(owner, lost)
        if spilled is not None and listener is not None:
            listener(spilled)
        if removed is not None:
            self._events.append(PagesRemoved(tuple(removed), self.medium, wire_tenant(owner)))
        return pages

    def _reuse(self, pages: list[KVPage]) -> None:
        """`get_new_pages`' bookkeeping when several tenants hold cached pages: the pages
        lose their hashes, each tenant its count, one `PagesRemoved` per tenant."""
        removed: dict[str, list[PageHash]] = {}
        lost: dict[str, int] = {}
        spilled: list[tuple[PageId, PageMeta]] = []
        listener = self.spill_listener
        cached = self._cached
        tenants = self.page_tenants
        for page in pages:
            page.ref_cnt = 1
            key = page.page_hash
            if key is None:
                continue
            owner = tenants[page.page_id] or DEFAULT_TENANT
            lost[owner] = lost.get(owner, 0) + 1
            entry = cached.get(key)
            if entry is page:
                del cached[key]
                if listener is not None:
                    spilled.append(
                        (page.page_id, PageMeta(key, page.parent_hash, page.lora_id, owner))
                    )
                removed.setdefault(owner, []).append(key)
                page.page_hash = page.parent_hash = None
            else:
                page.page_hash = page.parent_hash = None
                self._drop_copy(key, entry, page)
        for owner, n in lost.items():
            self._uncount(owner, n)
        if spilled and listener is not None:
            listener(spilled)
        for owner, keys in removed.items():
            self._events.append(PagesRemoved(tuple(keys), self.medium, wire_tenant(owner)))

    def _uncount(self, tenant: str, n: int) -> None:
        left = self.tenant_pages[tenant] - n
        if left:
            self.tenant_pages[tenant] = left
        else:
            del self.tenant_pages[tenant]

    def _oldest_free(self) -> Iterator[KVPage]:
        """Free pages from the queue's head (the next plain LRU reuses)."""
        page = self.free_queue.peek()
        while page is not None and page.page_id >= 0:
            yield page
            page = page.next_free

    def record(self, event: KVEvent) -> None:
        """Append a tier's event to the pool's stream, so one `take_events` keeps their order."""
        self._events.append(event)

    def _drop_copy(self, key: PageHash, entry: _CacheEntry | None, page: KVPage) -> None:
        """Forget one of several copies of `key` (the hash stays cached)."""
        if entry is None or type(entry) is KVPage:
            raise InvariantViolation(
                f"page {page.page_id} carries hash {key.hex()[:16]} that maps to "
                f"{None if entry is None else entry.page_id}"
            )
        copies: dict[PageId, KVPage] = entry  # type: ignore[assignment]
        if copies.pop(page.page_id, None) is None:
            raise InvariantViolation(
                f"page {page.page_id} carries hash {key.hex()[:16]} but is not among its copies "
                f"{sorted(copies)}"
            )
        if len(copies) == 1:
            self._cached[key] = next(iter(copies.values()))

    def touch(self, pages: Iterable[KVPage]) -> None:
        """Take hit pages: ref count +1, out of the free queue if it was 0."""
        remove = self.free_queue.remove  # raises if a ref_cnt-0 page is not queued
        queues = self._free_queues
        for p in pages:
            if not p.ref_cnt and not p.is_null:
                remove(p)
                if queues is not None:
                    queues.remove(p, self._tenant_of_free(p))
            p.ref_cnt += 1

    def free_pages(self, ordered_pages: Iterable[KVPage]) -> None:
        """Ref count -1; pages reaching 0 join the free queue in the given order.

        Callers pass a request's pages reversed, so its tail is evicted first.
        The pages keep their hashes until they are reused.
        """
        released: list[KVPage] = []
        push = released.append
        for page in ordered_pages:
            rc = page.ref_cnt - 1
            page.ref_cnt = rc
            if not rc:
                if not page.is_null:
                    push(page)
            elif rc < 0:
                page.ref_cnt = 0
                raise InvariantViolation(
                    f"page {page.page_id} freed more often than it was taken (ref_cnt {rc})"
                )
        self.free_queue.append_n(released)
        queues = self._free_queues
        if queues is not None:
            queues.push_n(self._with_tenants(released))

    # ------------------------------------------------------------------ caching

    def cache_page(
        self,
        page: KVPage,
        page_hash: PageHash,
        parent_hash: PageHash | None,
        token_ids: Sequence[int] = (),
        lora_id: int | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        """Cache one held, computed page under `page_hash` (emits `PagesStored` if new)."""
        if page.is_null or page.ref_cnt <= 0:
            raise InvalidInput(
                f"page {page.page_id} cannot be cached: "
                + ("it is the null page" if page.is_null else "it is not held (ref_cnt 0)")
            )
        if page.page_hash is not None:
            if page.page_hash == page_hash:
                return
            raise InvalidInput(
                f"page {page.page_id} is already cached under another hash; "
                "a computed page's content never changes"
            )
        if token_ids and len(token_ids) != self.page_size:
            raise InvalidInput(
                f"a page holds {self.page_size} tokens, got {len(token_ids)} token ids"
            )
        if self._insert(page, page_hash, parent_hash, lora_id, tenant):
            self._events.append(
                PagesStored(
                    (page_hash,),
                    parent_hash,
                    tuple(token_ids) if self.event_token_ids else (),
                    self.page_size,
                    lora_id,
                    self.medium,
                    wire_tenant(tenant),
                )
            )

    def _insert(
        self, page: KVPage, key: PageHash, parent: PageHash | None, lora_id: int | None, tenant: str
    ) -> bool:
        """Map `key` to `page`; True when `key` was not cached before."""
        page.page_hash = key
        page.parent_hash = parent
        page.lora_id = lora_id
        self.page_tenants[page.page_id] = tenant
        self.tenant_pages[tenant] += 1
        cached = self._cached
        entry = cached.get(key)
        if entry is None:
            cached[key] = page
            return True
        if type(entry) is KVPage:
            cached[key] = {entry.page_id: entry, page.page_id: page}
        else:
            entry[page.page_id] = page  # type: ignore[index]
        return False

    def cache_full_pages(
        self,
        pages: Sequence[KVPage],
        page_hashes: Sequence[PageHash],
        num_cached_pages: int,
        num_full_pages: int,
        token_ids: Sequence[int] = (),
        lora_id: int | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        """Cache ``pages[num_cached:num_full]`` under ``page_hashes[num_cached:num_full]``.

        `pages` and `page_hashes` are a request's whole lists (index i is page
        i); `token_ids` its tokens, or empty when the events need not carry
        them. Null pages (skipped by a sliding window) are left alone. Emits
        one `PagesStored` per run of newly cached hashes (normally exactly one).
        """
        if num_cached_pages >= num_full_pages:
            return
        if num_full_pages > len(pages) or num_full_pages > len(page_hashes) or num_cached_pages < 0:
            raise InvalidInput(
                f"cannot cache pages [{num_cached_pages}:{num_full_pages}] of a request with "
                f"{len(pages)} pages and {len(page_hashes)} page hashes"
            )
        cached = self._cached
        get = cached.get
        tenants = self.page_tenants
        hashed = 0
        parent = page_hashes[num_cached_pages - 1] if num_cached_pages else None
        run_start = num_cached_pages  # first page of the current run of new hashes
        for i in range(num_cached_pages, num_full_pages):
            page = pages[i]
            key = page_hashes[i]
            if page.page_hash is None and not page.is_null:
                page.page_hash = key
                page.parent_hash = parent
                page.lora_id = lora_id
                tenants[page.page_id] = tenant
                hashed += 1
                parent = key
                entry = get(key)
                if entry is None:
                    cached[key] = page
                    continue
                if type(entry) is KVPage:
                    cached[key] = {entry.page_id: entry, page.page_id: page}
                else:
                    entry[page.page_id] = page  # type: ignore[index]
            elif not page.is_null and page.page_hash != key:
                raise InvalidInput(
                    f"page {page.page_id} is already cached under another hash; "
                    "a computed page's content never changes"
                )
            parent = key
            # Not newly cached (a copy, already cached, or null): the run ends here.
            if run_start < i:
                self._stored(page_hashes, run_start, i, token_ids, lora_id, tenant)
            run_start = i + 1
        if hashed:
            self.tenant_pages[tenant] += hashed
        if run_start < num_full_pages:
            self._stored(page_hashes, run_start, num_full_pages, token_ids, lora_id, tenant)

    def _stored(
        self,
        page_hashes: Sequence[PageHash],
        start: int,
        end: int,
        token_ids: Sequence[int],
        lora_id: int | None,
        tenant: str,
    ) -> None:
        size = self.page_size
        tokens = (
            tuple(token_ids[start * size : end * size])
            if token_ids and self.event_token_ids
            else ()
        )
        self._events.append(
            PagesStored(
                tuple(page_hashes[start:end]),
                page_hashes[start - 1] if start else None,
                tokens,
                size,
                lora_id,
                self.medium,
                wire_tenant(tenant),
            )
        )

    def evict_pages(self, hashes: Iterable[PageHash]) -> int:
        """Forget the given hashes (every copy); returns how many were cached.

        Held pages stay held and usable by their requests; they just can no
        longer be hit. Free pages stay where they are in the queue.
        """
        removed: dict[str, list[PageHash]] = {}
        cached = self._cached
        for key in hashes:
            entry = cached.pop(key, None)
            if entry is None:
                continue
            copies = [entry] if type(entry) is KVPage else list(entry.values())  # type: ignore[union-attr]
            owner = DEFAULT_TENANT
            queues = self._free_queues
            for page in copies:
                if queues is not None and not page.ref_cnt:
                    # a free page keeps its place in the free queue, now holding no data
                    queues.remove(page, self._tenant_of_free(page))
                    queues.push(page, None)
                page.page_hash = page.parent_hash = None
                page.lora_id = None
                owner = self._untenant(page)
            removed.setdefault(owner, []).append(key)
        for owner, keys in removed.items():
            self._events.append(PagesRemoved(tuple(keys), self.medium, wire_tenant(owner)))
        return sum(len(keys) for keys in removed.values())

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; refuses (`PagesInUse`) while any page is held."""
        held = self.num_pages - 1 - self.free_queue.num_free_pages
        if held:
            raise PagesInUse(
                f"cannot reset the prefix cache: {held} pages are held by running requests; "
                "free them first"
            )
        self._cached.clear()
        for page in self.pages:
            page.page_hash = page.parent_hash = None
            page.lora_id = None
        self.page_tenants = [None] * self.num_pages
        self.tenant_pages.clear()
        if self._eviction is not None:
            self._requeue()
        self._events.append(AllPagesCleared())

    def _untenant(self, page: KVPage) -> str:
        owner = self.page_tenants[page.page_id] or DEFAULT_TENANT
        self.page_tenants[page.page_id] = None
        self.tenant_pages[owner] -= 1
        if not self.tenant_pages[owner]:
            del self.tenant_pages[owner]
        return owner

    def page_meta(self, page: KVPage) -> PageMeta | None:
        """A cached page's identity and tenant (None: not cached)."""
        if page.page_hash is None:
            return None
        return PageMeta(
            page.page_hash,
            page.parent_hash,
            page.lora_id,
            self.page_tenants[page.page_id] or DEFAULT_TENANT,
        )

    # ------------------------------------------------------------------- events

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first; the queue is left empty."""
        events = self._events
        self._events = []
        return events

    def snapshot_events(self) -> list[PagesStored]:
        """The worker's whole cached set as events: every tier's when tiers are attached
        (`snapshot_hook`), else the pool's (`device_snapshot_events`)."""
        if self.snapshot_hook is not None:
            return self.snapshot_hook()
        return self.device_snapshot_events()

    def device_snapshot_events(self) -> list[PagesStored]:
        """The pool's cached set as events, one per hash, parents before children.

        For a snapshot batch; token ids are not kept per page, so they are empty.
        """
        size, medium = self.page_size, self.medium
        out: list[PagesStored] = []
        for key, entry in self._cached.items():
            page = entry if type(entry) is KVPage else next(iter(entry.values()))  # type: ignore[union-attr]
            owner = wire_tenant(self.page_tenants[page.page_id] or DEFAULT_TENANT)
            out.append(PagesStored((key,), page.parent_hash, (), size, page.lora_id, medium, owner))
        known = {ev.page_hashes[0] for ev in out}
        # Order so that a page's cached parent precedes it: an index rebuilding
        # chains never sees a child first.
        ordered: list[PagesStored] = []
        emitted: set[PageHash] = set()
        by_parent: dict[PageHash | None, list[PagesStored]] = {}
        for ev in out:
            parent = ev.parent_hash if ev.parent_hash in known else None
            by_parent.setdefault(parent, []).append(ev)
        stack = list(reversed(by_parent.get(None, [])))
        while stack:
            ev = stack.pop()
            h = ev.page_hashes[0]
            if h in emitted:
                continue
            emitted.add(h)
            ordered.append(ev)
            stack.extend(reversed(by_parent.get(h, [])))
        ordered.extend(ev for ev in out if ev.page_hashes[0] not in emitted)  # cycles: impossible
        return ordered

    # --------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise `InvariantViolation` naming the bad state unless the pool is consistent.

        Checks: the null page is never free or cached; every other page is either
        in the free queue with ref count 0 or held with ref count > 0; the queue's
        links and count agree; the hash map and the pages' hashes agree. O(num_pages).
        """
        self.free_queue.check()
        null = self.null_page
        if null.prev_free is not None or null.next_free is not None:
            raise InvariantViolation("the null page is in the free queue")
        if null.page_hash is not None or null.ref_cnt < 0:
            raise InvariantViolation(f"the null page is cached or has ref_cnt {null.ref_cnt} < 0")
        free_ids = {p.page_id for p in self.free_queue.get_all_free_pages()}
        for page in self.pages[1:]:
            in_queue = page.page_id in free_ids
            if in_queue and page.ref_cnt != 0:
                raise InvariantViolation(
                    f"page {page.page_id} is in the free queue with ref_cnt {page.ref_cnt}"
                )
            if not in_queue and page.ref_cnt <= 0:
                raise InvariantViolation(
                    f"page {page.page_id} has ref_cnt {page.ref_cnt} but is not in the free queue"
                )
            if not in_queue and (page.prev_free is not None or page.next_free is not None):
                raise InvariantViolation(f"held page {page.page_id} still has free-queue links")
            if page.page_hash is not None:
                entry = self._cached.get(page.page_hash)
                ids = (
                    set()
                    if entry is None
                    else {entry.page_id}
                    if type(entry) is KVPage
                    else set(entry)  # type: ignore[arg-type]
                )
                if page.page_id not in ids:
                    raise InvariantViolation(
                        f"page {page.page_id} carries hash {page.page_hash.hex()[:16]} that the "
                        f"hash map does not map to it (maps to {sorted(ids)})"
                    )
        if self._free_queues is not None:
            by_tenant: dict[str | None, list[KVPage]] = {}
            for page in self.free_queue.get_all_free_pages():
                by_tenant.setdefault(self._tenant_of_free(page), []).append(page)
            queued = self._free_queues.as_lists()
            # pages that lost their data keep their places, so only the tenants' are in order
            if {t: q for t, q in queued.items() if t is not None} != {
                t: q for t, q in by_tenant.items() if t is not None
            } or set(queued.get(None, ())) != set(by_tenant.get(None, ())):
                raise InvariantViolation(
                    "the free pages queued per tenant are not the free queue's per tenant in order"
                )
        tenant_counts = Counter(
            self.page_tenants[p.page_id] for p in self.pages if p.page_hash is not None
        )
        if None in tenant_counts or tenant_counts != self.tenant_pages:
            raise InvariantViolation(
                f"cached pages per tenant {dict(tenant_counts)} != counted {dict(self.tenant_pages)}"
            )
        for key, entry in self._cached.items():
            copies = [entry] if type(entry) is KVPage else list(entry.values())  # type: ignore[union-attr]
            if type(entry) is not KVPage and len(copies) < 2:
                raise InvariantViolation(
                    f"hash {key.hex()[:16]} keeps a copy dict of {len(copies)} pages"
                )
            for page in copies:
                if page.page_hash != key or self.pages[page.page_id] is not page or page.is_null:
                    raise InvariantViolation(
                        f"hash map entry {key.hex()[:16]} points at page {page.page_id} "
                        f"whose hash is {page.page_hash.hex()[:16] if page.page_hash else None}"
                    )
