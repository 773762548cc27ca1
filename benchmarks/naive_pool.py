"""The naive baseline for `kvmesh bench pool`: the same prefix cache, written plainly.

What a first implementation would look like: a Python object per page, a
``hash -> {page_id: page}`` dict, and the free pages in an `OrderedDict`
(insertion order = LRU order, O(1) removal on a hit), one page at a time
through small helper methods. It keeps the pool's exact policy (null page,
tail-first free, hashes kept until reuse, `num_tokens - 1` cap, events on
every change of the cached set), so on the same replay it reaches the same
hit ratio and only the speed differs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.events import KVEvent, PagesRemoved, PagesStored
from kvmesh.types import PageHash


class NaivePage:
    def __init__(self, page_id: int) -> None:
        self.page_id = page_id
        self.ref_cnt = 0
        self.page_hash: PageHash | None = None


class NaivePrefixCache:
    """Pool and cache manager in one class; one request at a time, no groups."""

    def __init__(
        self, num_pages: int, page_size: int, medium: str = "cpu", event_token_ids: bool = False
    ) -> None:
        self.page_size = page_size
        self.event_token_ids = event_token_ids
        self.medium = medium
        self.pages = [NaivePage(i) for i in range(num_pages)]
        self.free_pages: OrderedDict[int, NaivePage] = OrderedDict(
            (p.page_id, p)
            for p in self.pages[1:]  # page 0 is the null page
        )
        self.cached: dict[PageHash, dict[int, NaivePage]] = {}
        self.req_pages: dict[str, list[NaivePage]] = {}
        self.events: list[KVEvent] = []

    def lookup(self, page_hash: PageHash) -> NaivePage | None:
        copies = self.cached.get(page_hash)
        if not copies:
            return None
        return next(iter(copies.values()))

    def get_computed_pages(self, hashes: Sequence[PageHash], num_tokens: int) -> list[NaivePage]:
        max_pages = min((num_tokens - 1) // self.page_size, len(hashes))
        hit = []
        for i in range(max_pages):
            page = self.lookup(hashes[i])
            if page is None:
                break
            hit.append(page)
        return hit

    def _take(self, page: NaivePage) -> None:
        if page.ref_cnt == 0:
            del self.free_pages[page.page_id]
        page.ref_cnt += 1

    def _evict(self, page: NaivePage) -> None:
        h = page.page_hash
        if h is None:
            return
        copies = self.cached[h]
        del copies[page.page_id]
        page.page_hash = None
        if not copies:
            del self.cached[h]
            self.events.append(PagesRemoved((h,), self.medium))

    def _allocate_one(self) -> NaivePage:
        _, page = self.free_pages.popitem(last=False)
        self._evict(page)
        page.ref_cnt = 1
        return page

    def _release(self, page: NaivePage) -> None:
        page.ref_cnt -= 1
        if page.ref_cnt == 0:
            self.free_pages[page.page_id] = page

    def allocate(
        self,
        request_id: str,
        hit: list[NaivePage],
        hashes: Sequence[PageHash],
        token_ids: Sequence[int],
        lora_id: int | None = None,
    ) -> list[NaivePage] | None:
        """Take the hits, allocate the rest of the prompt, cache its full pages."""
        num_tokens = len(token_ids)
        required = -(-num_tokens // self.page_size)
        new_count = required - len(hit)
        evictable = sum(1 for p in hit if p.ref_cnt == 0)
        if new_count + evictable > len(self.free_pages):
            return None
        for page in hit:
            self._take(page)
        new = [self._allocate_one() for _ in range(new_count)]
        pages = hit + new
        self.req_pages[request_id] = pages
        num_full = min(num_tokens // self.page_size, len(hashes))
        stored = []
        for i in range(len(hit), num_full):
            page = pages[i]
            page.page_hash = hashes[i]
            copies = self.cached.setdefault(hashes[i], {})
            if not copies:
                stored.append(hashes[i])
            copies[page.page_id] = page
        if stored:
            start = len(hit)
            self.events.append(
                PagesStored(
                    tuple(stored),
                    hashes[start - 1] if start else None,
                    tuple(token_ids[start * self.page_size : num_full * self.page_size])
                    if self.event_token_ids
                    else (),
                    self.page_size,
                    lora_id,
                    self.medium,
                )
            )
        return new

    def free(self, request_id: str) -> None:
        for page in reversed(self.req_pages.pop(request_id, [])):
            self._release(page)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
