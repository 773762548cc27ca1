"""The KV cache manager: which pages each request holds, on top of one `PagePool`.

Semantics of vLLM v1's ``KVCacheManager`` and its per-group managers, and of
EasyDeL eSurge's cache manager coordinating ``kv_cache_groups``:

- `get_computed_pages`: the longest cached prefix of the request's pages, at
  most ``num_tokens - 1`` tokens (the last token is always recomputed to get
  its logits); nothing when caching is off or the request wants prompt
  logprobs (those need every position computed);
- `allocate_slots`: takes the hit pages, allocates pages for the new tokens
  (plus lookahead), and caches the pages that become full, unless
  `delay_caching`; returns None and changes nothing when the pool cannot hold
  them;
- `free`: releases a request's pages tail-first, so a prefix's head stays
  cached longest;
- `fork` shares a request's pages with a child by reference count;
  `prepare_write` copies a shared (or cached) page before it is written
  (copy-on-write) and says which page's KV the caller must copy.

KV-cache groups: one manager serves one or more groups, each with its own
pages in the shared pool. A full-attention group needs every page of a prefix;
a sliding-window group only the pages its window covers (the ones before are
the null page). The computed prefix is the longest valid for every group.
Pages of group ``g > 0`` are cached under the page hash tagged with ``g``
(two bytes appended), so groups never hit each other's pages.

Tiers: a manager built with ``tiers=`` (a `kvmesh.worker.tiered_cache.TieredCache`
over the same pool) has every lookup first promote the lower tiers' pages that
extend the device's prefix, so they are hit instead of recomputed. Tenants: a
request's pages count against `tenant_of` its cache salt, which the pool's
eviction policy weighs.

Not thread-safe: the worker holds a lock around every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, overload

from kvmesh.config import PoolConfig
from kvmesh.errors import ConfigError, InvalidInput
from kvmesh.events import KVEvent
from kvmesh.hashing import RequestHashes, reusable_pages
from kvmesh.tenants import tenant_of
from kvmesh.types import PageHash, PageId
from kvmesh.worker.free_queue import KVPage
from kvmesh.worker.page_pool import PagePool


@dataclass(slots=True)
class Request:
    """What the manager needs of a request: its id, tokens and page hashes.

    `num_computed_tokens` is the scheduler's count of tokens whose KV is in
    the request's pages (it advances after each step); `lora_id` goes into
    the KV events (None: taken from the hashes' extra keys).
    """

    request_id: str
    hashes: RequestHashes
    num_computed_tokens: int = 0
    prompt_logprobs: bool = False
    lora_id: int | None = None
    tenant: str = ""  # "": `tenant_of` the hashes' cache salt

    def __post_init__(self) -> None:
        if self.lora_id is None:
            self.lora_id = self.hashes.keys.lora_id
        if not self.tenant:
            self.tenant = tenant_of(self.hashes.keys.cache_salt)

    @property
    def token_ids(self) -> list[int]:
        return self.hashes.token_ids

    @property
    def page_hashes(self) -> list[PageHash]:
        return self.hashes.hashes

    @property
    def num_tokens(self) -> int:
        return len(self.hashes.token_ids)


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One KV-cache group: `full_attention`, or `sliding_window` over `sliding_window` tokens."""

    kind: str = "full_attention"
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ConfigError(
                f"unknown KV-cache group kind {self.kind!r}; choose one of {sorted(GROUP_KINDS)}"
            )
        if self.kind == "sliding_window" and (
            self.sliding_window is None or self.sliding_window < 1
        ):
            raise ConfigError(
                f"a sliding_window group needs a window of at least 1 token, got {self.sliding_window}"
            )


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups: requests asked, tokens asked about, tokens found."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class _TaggedKeys(Sequence[PageHash]):
    """A request's page hashes seen as group ``g``'s cache keys, without copying them."""

    __slots__ = ("_hashes", "_tag")

    def __init__(self, hashes: Sequence[PageHash], tag: bytes) -> None:
        self._hashes = hashes
        self._tag = tag

    def __len__(self) -> int:
        return len(self._hashes)

    @overload
    def __getitem__(self, i: int) -> PageHash: ...
    @overload
    def __getitem__(self, i: slice) -> list[PageHash]: ...
    def __getitem__(self, i: int | slice) -> PageHash | list[PageHash]:
        if isinstance(i, slice):
            return [PageHash(h + self._tag) for h in self._hashes[i]]
        return PageHash(self._hashes[i] + self._tag)


def group_key(page_hash: PageHash, group_id: int) -> PageHash:
    """The key group `group_id` caches a page under (the plain hash for group 0)."""
    return page_hash if group_id == 0 else PageHash(page_hash + group_id.to_bytes(2, "big"))


class _Group:
    """Pages of one KV-cache group per request; full attention by default."""

    __slots__ = ("group_id", "num_cached", "page_size", "pool", "req_pages", "spec", "tag")

    def __init__(self, pool: PagePool, page_size: int, group_id: int, spec: KVCacheGroupSpec):
        self.pool = pool
        self.page_size = page_size
        self.group_id = group_id
        self.spec = spec
        self.tag = b"" if group_id == 0 else group_id.to_bytes(2, "big")
        self.req_pages: dict[str, list[KVPage]] = {}
        self.num_cached: dict[str, int] = {}

    def keys(self, hashes: list[PageHash]) -> Sequence[PageHash]:
        return hashes if not self.tag else _TaggedKeys(hashes, self.tag)

    def find_longest_hit(
        self, keys: Sequence[PageHash], max_pages: int, use_eagle: bool
    ) -> list[KVPage]:
        """Hit pages of the longest valid prefix of at most `max_pages` pages."""
        return self.pool.match_prefix(keys, max_pages)

    def num_skipped_pages(self, num_computed_tokens: int) -> int:
        """Leading pages no longer needed once `num_computed_tokens` are computed."""
        return 0

    def num_common_prefix(self, pages: list[KVPage], num_requests: int) -> int:
        count = 0
        for page in pages:
            if page.ref_cnt != num_requests:
                break
            count += 1
        return count

    def num_freed_by_skipping(self, request_id: str, num_computed_tokens: int) -> int:
        """How many pages `remove_skipped` would return to the free queue."""
        return 0

    def remove_skipped(self, request_id: str, num_computed_tokens: int) -> None:
        return


class _SlidingWindowGroup(_Group):
    """Only the last `sliding_window` tokens' pages matter; the ones before are null."""

    __slots__ = ("window",)

    def __init__(self, pool: PagePool, page_size: int, group_id: int, spec: KVCacheGroupSpec):
        super().__init__(pool, page_size, group_id, spec)
        self.window: int = spec.sliding_window or 1

    def find_longest_hit(
        self, keys: Sequence[PageHash], max_pages: int, use_eagle: bool
    ) -> list[KVPage]:
        # A prefix of L pages is valid when the pages its last token can see
        # (ceil((window - 1) / page_size) of them, one more for EAGLE, which
        # drops the last) are all cached; scan from the right for such a run.
        need = max(1, -(-(self.window - 1) // self.page_size) + (1 if use_eagle else 0))
        get = self.pool.get_cached_page
        run: list[KVPage] = []
        for i in range(min(max_pages, len(keys)) - 1, -1, -1):
            page = get(keys[i])
            if page is None:
                run.clear()
                continue
            run.append(page)
            if len(run) >= need:
                run.reverse()
                return [self.pool.null_page] * i + run
        run.reverse()  # no full window: the hit pages from the very start still count
        return run

    def num_common_prefix(self, pages: list[KVPage], num_requests: int) -> int:
        return 0  # leading pages become null as the window slides: nothing stays common

    def num_skipped_pages(self, num_computed_tokens: int) -> int:
        skipped = num_computed_tokens - self.window + 1
        return skipped // self.page_size if skipped > 0 else 0

    def num_freed_by_skipping(self, request_id: str, num_computed_tokens: int) -> int:
        pages = self.req_pages.get(request_id)
        if not pages:
            return 0
        n = min(self.num_skipped_pages(num_computed_tokens), len(pages))
        return sum(1 for p in pages[:n] if not p.is_null and p.ref_cnt == 1)

    def remove_skipped(self, request_id: str, num_computed_tokens: int) -> None:
        pages = self.req_pages.get(request_id)
        if not pages:
            return
        n = min(self.num_skipped_pages(num_computed_tokens), len(pages))
        null = self.pool.null_page
        removed: list[KVPage] = []
        for i in range(n - 1, -1, -1):
            if pages[i].is_null:
                break
            removed.append(pages[i])
            pages[i] = null
        self.pool.touch([null] * len(removed))  # the null page is counted like any other
        self.pool.free_pages(removed)


GROUP_KINDS: dict[str, type[_Group]] = {
    "full_attention": _Group,
    "sliding_window": _SlidingWindowGroup,
}
"""Registry of KV-cache group kinds by name."""

FULL_ATTENTION = KVCacheGroupSpec()


class PagePromoter(Protocol):
    """Lower tiers under the manager's pool (`kvmesh.worker.tiered_cache.TieredCache`)."""

    pool: PagePool

    def promote(self, page_hashes: Sequence[PageHash], max_pages: int) -> int:
        """Cache in the pool the lower tiers' pages extending its prefix of `page_hashes`."""
        ...

    def reset(self) -> None:
        """Forget every tier's pages (the pool's too)."""
        ...

    def prefetch(self, page_hashes: Sequence[PageHash], max_pages: int) -> int:
        """Read what a `promote` would read from slow tiers, without the owner's lock."""
        ...


class KVCacheManager:
    """Per-request pages over one `PagePool`, with prefix caching.

    Cost per call is O(pages touched) plus a few dict operations; nothing is
    logged or allocated per page beyond the result lists.
    """

    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        *,
        enable_caching: bool = True,
        groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
        use_eagle: bool = False,
        tiers: PagePromoter | None = None,
    ) -> None:
        if page_size != pool.page_size:
            raise ConfigError(
                f"cache manager page_size {page_size} differs from the pool's {pool.page_size}"
            )
        if not groups:
            raise ConfigError("a cache manager needs at least one KV-cache group")
        self.pool = pool
        self.page_size = page_size
        self.enable_caching = enable_caching and pool.enable_caching
        self.use_eagle = use_eagle
        self.groups: list[_Group] = [
            GROUP_KINDS[spec.kind](pool, page_size, gid, spec) for gid, spec in enumerate(groups)
        ]
        self.tiers: PagePromoter | None = None
        if tiers is not None:
            self.attach_tiers(tiers)
        self._requests = 0
        self._queries = 0
        self._hits = 0
        # Per-request (queries, hits) of requests holding pages; the last
        # lookup waits in `_last_lookup` until its request gets pages, so
        # lookups of requests that never run cannot grow the dict.
        self._req_stats: dict[str, tuple[int, int]] = {}
        self._last_lookup: tuple[str, int, int] | None = None
        # One plain full-attention group (the common case) takes the fast paths.
        self._single = len(groups) == 1 and type(self.groups[0]) is _Group

    @classmethod
    def from_config(
        cls,
        pool: PagePool,
        cfg: PoolConfig,
        groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
        tiers: PagePromoter | None = None,
    ) -> KVCacheManager:
        return cls(
            pool,
            pool.page_size,
            enable_caching=cfg.enable_caching,
            groups=groups,
            use_eagle=cfg.use_eagle,
            tiers=tiers,
        )

    def attach_tiers(self, tiers: PagePromoter) -> None:
        """Have every lookup promote from `tiers` first; `ConfigError` when they cannot fit."""
        if tiers.pool is not self.pool:
            raise ConfigError("the tiers given to a cache manager must sit under its own pool")
        if len(self.groups) != 1 or type(self.groups[0]) is not _Group:
            raise ConfigError(
                "tiers work with one full-attention KV-cache group; drop the tiers or the groups"
            )
        self.tiers = tiers

    # ------------------------------------------------------------------ lookups

    def get_computed_pages(self, request: Request) -> tuple[list[KVPage], int]:
        """The hit pages (first group) and the number of tokens they cover.

        Never the whole prompt: at most ``num_tokens - 1`` tokens. With several
        groups use `get_computed_pages_by_group` and pass its pages on.
        """
        if not self._single:
            by_group, n = self.get_computed_pages_by_group(request)
            return by_group[0], n
        if not self.enable_caching or request.prompt_logprobs:
            return [], 0
        rh = request.hashes
        num_tokens = len(rh.token_ids)
        ps = self.page_size
        if self.tiers is not None:
            self.tiers.promote(rh.hashes, (num_tokens - 1) // ps)
        pages = self.pool.match_prefix(rh.hashes, reusable_pages(num_tokens, ps))
        if self.use_eagle and pages:
            pages.pop()  # recompute the last page so its hidden states exist
        n_tokens = len(pages) * ps
        self._requests += 1
        self._queries += num_tokens
        self._hits += n_tokens
        self._last_lookup = (request.request_id, num_tokens, n_tokens)
        return pages, n_tokens

    def get_computed_pages_by_group(self, request: Request) -> tuple[tuple[list[KVPage], ...], int]:
        """The hit pages of every group (same length) and the tokens they cover."""
        groups = self.groups
        if not self.enable_caching or request.prompt_logprobs:
            return tuple([] for _ in groups), 0
        hashes = request.hashes.hashes
        num_tokens = len(request.hashes.token_ids)
        max_pages = reusable_pages(num_tokens, self.page_size)
        eagle = self.use_eagle
        if self.tiers is not None:
            self.tiers.promote(hashes, max_pages)
        if len(groups) == 1:
            found: list[list[KVPage]] = [groups[0].find_longest_hit(hashes, max_pages, eagle)]
        else:
            found = self._converge(hashes, max_pages, eagle)
        if eagle and found[0]:
            for pages in found:
                pages.pop()  # recompute the last page so its hidden states exist
        n_tokens = len(found[0]) * self.page_size
        self._requests += 1
        self._queries += num_tokens
        self._hits += n_tokens
        self._last_lookup = (request.request_id, num_tokens, n_tokens)
        return tuple(found), n_tokens

    def _converge(self, hashes: list[PageHash], max_pages: int, eagle: bool) -> list[list[KVPage]]:
        # Each group returns its longest valid prefix within the bound so far;
        # shrinking the bound can shrink another group's answer, so repeat
        # until every group agrees. The bound only decreases, so this ends.
        bound = max_pages
        while True:
            found = []
            for g in self.groups:
                pages = g.find_longest_hit(g.keys(hashes), bound, eagle)
                bound = len(pages)
                found.append(pages)
            if all(len(p) == bound for p in found):
                return found

    # --------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_pages: Sequence[KVPage] | tuple[Sequence[KVPage], ...] | None = None,
        lookahead: int = 0,
        delay_caching: bool = False,
    ) -> list[KVPage] | None:
        """Give `request` pages for its new tokens; None (nothing changed) when they don't fit.

        `new_computed_pages` are the hits from `get_computed_pages` (a list for
        one group, or the per-group tuple of `get_computed_pages_by_group`) and
        `num_new_computed_tokens` the tokens they cover; only a request that
        holds no pages yet may bring them. Pages are allocated for
        ``num_computed_tokens + num_new_computed_tokens + num_new_tokens +
        lookahead`` tokens; the pages full after the new tokens are cached
        unless `delay_caching`. Returns the newly allocated pages of the first group.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or lookahead < 0:
            raise InvalidInput(
                f"token counts must be non-negative: num_new_tokens={num_new_tokens}, "
                f"num_new_computed_tokens={num_new_computed_tokens}, lookahead={lookahead}"
            )
        if self._single and (new_computed_pages is None or type(new_computed_pages) is list):
            return self._allocate_single(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_pages,
                lookahead,
                delay_caching,
            )
        groups = self.groups
        pool = self.pool
        rid = request.request_id
        computed = self._per_group(new_computed_pages)
        if computed is not None:
            if not self.enable_caching:
                raise InvalidInput("computed pages were passed but prefix caching is off")
            if rid in groups[0].req_pages:
                raise InvalidInput(
                    f"request {rid!r} already holds pages; only a new request brings computed pages"
                )
        ps = self.page_size
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens + lookahead) // ps)

        # Count first, change nothing until it is known to fit.
        need = 0
        num_free = pool.free_queue.num_free_pages
        prior = request.num_computed_tokens
        for gi, g in enumerate(groups):
            held = g.req_pages.get(rid)
            n_held = len(held) if held else 0
            comp = computed[gi] if computed is not None else ()
            new = num_required - n_held - len(comp)
            if new > 0:
                need += new
            for p in comp:
                if p.ref_cnt == 0 and not p.is_null:
                    need += 1  # a free hit page leaves the free queue
            if prior and held:
                num_free += g.num_freed_by_skipping(rid, prior)
        if need > num_free:
            return None

        first_new: list[KVPage] = []
        caching = self.enable_caching and not delay_caching
        num_to_cache = min(num_computed + num_new_tokens, len(request.hashes.token_ids))
        last = self._last_lookup
        if last is not None and last[0] == rid:
            self._req_stats[rid] = (last[1], last[2])
            self._last_lookup = None
        if prior:  # free what slid out of every window before allocating anything
            for g in groups:
                g.remove_skipped(rid, prior)
        for gi, g in enumerate(groups):
            pages = g.req_pages.get(rid)
            if pages is None:
                pages = g.req_pages[rid] = []
                g.num_cached[rid] = 0
            if computed is not None and computed[gi]:
                comp = computed[gi]
                pool.touch(comp)
                pages.extend(comp)
                g.num_cached[rid] = len(comp)
            new = num_required - len(pages)
            if new > 0:
                fresh = pool.get_new_pages(new, request.tenant)
                pages.extend(fresh)
                if gi == 0:
                    first_new = fresh
            if caching:
                self._cache(g, request, pages, num_to_cache)
        return first_new

    def _allocate_single(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        comp: list[KVPage] | None,
        lookahead: int,
        delay_caching: bool,
    ) -> list[KVPage] | None:
        # `allocate_slots` for one full-attention group: same steps, no loops
        # over groups, no sliding-window skipping.
        pool = self.pool
        rid = request.request_id
        g = self.groups[0]
        pages = g.req_pages.get(rid)
        n_comp = 0
        need = 0
        if comp:
            if not self.enable_caching:
                raise InvalidInput("computed pages were passed but prefix caching is off")
            if pages is not None:
                raise InvalidInput(
                    f"request {rid!r} already holds pages; only a new request brings computed pages"
                )
            n_comp = len(comp)
            for p in comp:
                if not p.ref_cnt:
                    need += 1  # a free hit page leaves the free queue
        ps = self.page_size
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        new = (
            -(-(num_computed + num_new_tokens + lookahead) // ps)
            - (len(pages) if pages is not None else 0)
            - n_comp
        )
        if new > 0:
            need += new
        if need > pool.free_queue.num_free_pages:
            return None
        if pages is None:
            pages = g.req_pages[rid] = []
            g.num_cached[rid] = 0
        if comp:
            pool.touch(comp)
            pages.extend(comp)
            g.num_cached[rid] = n_comp
        fresh = pool.get_new_pages(new, request.tenant) if new > 0 else []
        pages.extend(fresh)
        last = self._last_lookup
        if last is not None and last[0] == rid:
            self._req_stats[rid] = (last[1], last[2])
            self._last_lookup = None
        if self.enable_caching and not delay_caching:
            rh = request.hashes
            num_full = min(num_computed + num_new_tokens, len(rh.token_ids)) // ps
            if num_full > len(rh.hashes):
                num_full = len(rh.hashes)
            num_cached = g.num_cached[rid]
            if num_cached < num_full:
                pool.cache_full_pages(
                    pages,
                    rh.hashes,
                    num_cached,
                    num_full,
                    rh.token_ids,
                    request.lora_id,
                    request.tenant,
                )
                g.num_cached[rid] = num_full
        return fresh

    def _per_group(
        self, pages: Sequence[KVPage] | tuple[Sequence[KVPage], ...] | None
    ) -> tuple[Sequence[KVPage], ...] | None:
        if not pages:
            return None
        if isinstance(pages, tuple) and pages and not isinstance(pages[0], KVPage):
            if len(pages) != len(self.groups):
                raise InvalidInput(
                    f"computed pages for {len(pages)} groups, but the manager has {len(self.groups)}"
                )
            if len({len(p) for p in pages}) != 1:
                raise InvalidInput("computed pages of every group must cover the same tokens")
            return pages if any(pages) else None
        if len(self.groups) != 1:
            raise InvalidInput(
                f"the manager has {len(self.groups)} KV-cache groups: pass the per-group tuple "
                "from get_computed_pages_by_group"
            )
        return (pages,)  # type: ignore[return-value]

    def _cache(self, g: _Group, request: Request, pages: list[KVPage], num_tokens: int) -> None:
        rh = request.hashes
        num_full = num_tokens // self.page_size
        if num_full > len(rh.hashes):
            num_full = len(rh.hashes)
        rid = request.request_id
        num_cached = g.num_cached[rid]
        if num_cached >= num_full:
            return
        self.pool.cache_full_pages(
            pages,
            g.keys(rh.hashes),
            num_cached,
            num_full,
            rh.token_ids,
            request.lora_id,
            request.tenant,
        )
        g.num_cached[rid] = num_full

    def cache_pages(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's pages that are full once `num_computed_tokens` are computed.

        For callers that allocated with `delay_caching` (e.g. pages filled by a
        transfer): call when their KV is in place.
        """
        if not self.enable_caching:
            return
        n = min(num_computed_tokens, len(request.hashes.token_ids))
        for g in self.groups:
            pages = g.req_pages.get(request.request_id)
            if pages:
                self._cache(g, request, pages, n)

    # ------------------------------------------------------------------ release

    def free(self, request: Request | str) -> None:
        """Release a request's pages, tail first (the tail is evicted first); idempotent."""
        rid = request if isinstance(request, str) else request.request_id
        pool = self.pool
        self._req_stats.pop(rid, None)
        if self._last_lookup is not None and self._last_lookup[0] == rid:
            self._last_lookup = None
        if self._single:
            g = self.groups[0]
            pages = g.req_pages.pop(rid, None)
            if pages:
                del g.num_cached[rid]
                pool.free_pages(reversed(pages))
            return
        for g in self.groups:
            pages = g.req_pages.pop(rid, None)
            g.num_cached.pop(rid, None)
            if pages:
                pool.free_pages(reversed(pages))

    def fork(self, request: Request | str, child_id: str) -> list[KVPage]:
        """Give `child_id` every page of `request`, shared by reference count.

        The child's pages count as already cached; a page either of them
        writes is copied first (`prepare_write`). Returns the child's pages
        (first group).
        """
        rid = request if isinstance(request, str) else request.request_id
        first = self.groups[0].req_pages
        if rid not in first:
            raise InvalidInput(f"cannot fork request {rid!r}: it holds no pages")
        if child_id in first:
            raise InvalidInput(f"cannot fork into {child_id!r}: that request already holds pages")
        for g in self.groups:
            pages = list(g.req_pages[rid])
            self.pool.touch(pages)
            g.req_pages[child_id] = pages
            g.num_cached[child_id] = g.num_cached.get(rid, 0)
        return first[child_id]

    def prepare_write(
        self, request_id: str, page_index: int, group: int = 0
    ) -> tuple[PageId, PageId | None]:
        """Make page `page_index` of the request writable; copy-on-write.

        A page held only by this request and not cached is written in place:
        returns ``(page_id, None)``. A shared page (after `fork`) or a cached
        one (others may hit it) is replaced by a fresh page: returns
        ``(new_page_id, source_page_id)`` and the caller copies the KV of the
        source page into the new one before writing. Raises `PoolExhausted`
        when no page is free for the copy (nothing changed then).
        """
        if not 0 <= group < len(self.groups):
            raise InvalidInput(f"group {group} does not exist (the manager has {len(self.groups)})")
        pages = self.groups[group].req_pages.get(request_id)
        if pages is None:
            raise InvalidInput(f"request {request_id!r} holds no pages")
        if not -len(pages) <= page_index < len(pages):
            raise InvalidInput(
                f"page index {page_index} is out of range for request {request_id!r} "
                f"with {len(pages)} pages"
            )
        page = pages[page_index]
        if page.is_null:
            raise InvalidInput(
                f"page {page_index} of request {request_id!r} is the null page "
                "(outside the sliding window); it holds no KV to write"
            )
        if page.ref_cnt == 1 and page.page_hash is None:
            return page.page_id, None
        (fresh,) = self.pool.get_new_pages(1)
        pages[page_index] = fresh
        self.pool.free_pages([page])
        return fresh.page_id, page.page_id

    # ---------------------------------------------------------------- inspection

    def get_pages(self, request_id: str) -> list[KVPage]:
        """The request's pages of the first group, in token order (empty if none)."""
        return self.groups[0].req_pages.get(request_id, [])

    def get_pages_by_group(self, request_id: str) -> tuple[list[KVPage], ...]:
        return tuple(g.req_pages.get(request_id, []) for g in self.groups)

    def request_ids(self) -> list[str]:
        return list(self.groups[0].req_pages)

    def num_common_prefix_pages(
        self, request_id: str, num_running_requests: int | None = None
    ) -> list[int]:
        """Per group, how many leading pages of `request_id` every running request shares.

        A page is common when its ref count equals the number of running
        requests (default: the requests holding pages here).
        """
        n = len(self.groups[0].req_pages) if num_running_requests is None else num_running_requests
        return [g.num_common_prefix(g.req_pages.get(request_id, []), n) for g in self.groups]

    @property
    def stats(self) -> PrefixCacheStats:
        """Prefix-cache lookups since the manager was built."""
        return PrefixCacheStats(self._requests, self._queries, self._hits)

    def request_stats(self, request_id: str) -> PrefixCacheStats | None:
        """The last lookup of a request until it is freed (or another request is looked up
        before it got pages), or None."""
        entry = self._req_stats.get(request_id)
        if entry is None:
            last = self._last_lookup
            if last is None or last[0] != request_id:
                return None
            entry = last[1:]
        return PrefixCacheStats(1, entry[0], entry[1])

    @property
    def usage(self) -> float:
        return self.pool.usage

    def take_events(self) -> list[KVEvent]:
        """The pool's KV events since the last call (drained atomically)."""
        return self.pool.take_events()

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (every tier's); raises `PagesInUse` while requests hold pages."""
        if self.tiers is not None:
            self.tiers.reset()
        else:
            self.pool.reset_prefix_cache()
