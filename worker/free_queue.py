"""KV pages and the free page queue (the LRU order of eviction).

The queue is a doubly linked list threaded through the pages themselves
(`prev_free` / `next_free`), with a fake head and a fake tail so that no
operation needs a branch for "empty" or "first"::

    fake_head <-> p7 <-> p3 <-> p9 <-> fake_tail
                  ^ evicted / reused first       ^ freed last

Taking a page out of the middle (a cache hit on a free page) is O(1), which a
Python `deque` cannot do. Pages are appended when their reference count drops
to zero; a request's pages are appended tail-first by the caller, so the head
of a prefix outlives its tail.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmesh.errors import InvalidInput, InvariantViolation
from kvmesh.types import PageHash, PageId


@dataclass(slots=True, eq=False)
class KVPage:
    """One page of the pool: its id, reference count and (when full and cached) hash.

    `page_hash` is the key the page is cached under (the page hash, tagged with
    the KV-cache group for groups after the first); it stays set while the page
    sits in the free queue, so a freed page can still be hit until it is reused.
    `prev_free` / `next_free` are set exactly while the page is in the free queue.
    """

    page_id: PageId
    ref_cnt: int = 0
    page_hash: PageHash | None = None
    parent_hash: PageHash | None = None
    prev_free: KVPage | None = field(default=None, repr=False)
    next_free: KVPage | None = field(default=None, repr=False)
    is_null: bool = False
    lora_id: int | None = None


class FreePageQueue:
    """The free pages in eviction order (least recently used at the head).

    O(1): `popleft`, `remove`, `append`; O(n) in the pages moved: `popleft_n`,
    `append_n`. Not thread-safe; the pool's caller holds a lock.
    """

    __slots__ = ("_head", "_tail", "num_free_pages")

    def __init__(self, pages: Iterable[KVPage] = ()) -> None:
        self._head = KVPage(PageId(-1))
        self._tail = KVPage(PageId(-1))
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_pages = 0
        self.append_n(list(pages))

    def __len__(self) -> int:
        return self.num_free_pages

    def popleft(self) -> KVPage:
        """Take the least recently used free page; raises `InvalidInput` when empty."""
        page = self._head.next_free
        if page is None or page is self._tail:
            raise InvalidInput("no free page to pop: the free queue is empty")
        nxt = page.next_free
        self._head.next_free = nxt
        nxt.prev_free = self._head  # type: ignore[union-attr]
        page.prev_free = page.next_free = None
        self.num_free_pages -= 1
        return page

    def popleft_n(self, n: int) -> list[KVPage]:
        """Take the `n` least recently used pages, in order; raises when fewer are free."""
        if n <= 0:
            if n < 0:
                raise InvalidInput(f"cannot pop {n} pages")
            return []
        if n > self.num_free_pages:
            raise InvalidInput(f"cannot pop {n} pages: only {self.num_free_pages} are free")
        self.num_free_pages -= n
        out: list[KVPage] = []
        push = out.append
        page: KVPage = self._head.next_free  # type: ignore[assignment]
        for _ in range(n):
            push(page)
            nxt: KVPage = page.next_free  # type: ignore[assignment]
            page.prev_free = page.next_free = None
            page = nxt
        self._head.next_free = page
        page.prev_free = self._head
        return out

    def remove(self, page: KVPage) -> None:
        """Unlink `page` from anywhere in the queue in O(1)."""
        prev, nxt = page.prev_free, page.next_free
        if prev is None or nxt is None:
            raise InvalidInput(f"page {page.page_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        page.prev_free = page.next_free = None
        self.num_free_pages -= 1

    def remove_n(self, pages: list[KVPage]) -> None:
        """Unlink each of `pages` (all must be in the queue; not checked: hot path)."""
        for page in pages:
            prev: KVPage = page.prev_free  # type: ignore[assignment]
            nxt: KVPage = page.next_free  # type: ignore[assignment]
            prev.next_free = nxt
            nxt.prev_free = prev
            page.prev_free = page.next_free = None
        self.num_free_pages -= len(pages)

    def append(self, page: KVPage) -> None:
        """Put `page` at the tail (it will be evicted last)."""
        if page.prev_free is not None or page.next_free is not None:
            raise InvalidInput(f"page {page.page_id} is already in the free queue")
        last: KVPage = self._tail.prev_free  # type: ignore[assignment]
        last.next_free = page
        page.prev_free = last
        page.next_free = self._tail
        self._tail.prev_free = page
        self.num_free_pages += 1

    def append_n(self, pages: list[KVPage]) -> None:
        """Append `pages` at the tail in the given order (the first is evicted first).

        The pages must not be in the queue already (not checked: hot path; the
        pool's `check_invariants` would catch it).
        """
        if not pages:
            return
        last: KVPage = self._tail.prev_free  # type: ignore[assignment]
        for page in pages:
            page.prev_free = last
            last.next_free = page
            last = page
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_pages += len(pages)

    def peek(self) -> KVPage | None:
        """The page `popleft` would return, or None when the queue is empty."""
        page = self._head.next_free
        return None if page is self._tail else page

    def count_cached_in_head(self, n: int) -> int:
        """How many of the next `n` pages `popleft_n` would hand out still hold a hash; O(n)."""
        count = 0
        page = self._head.next_free
        tail = self._tail
        while n > 0 and page is not None and page is not tail:
            count += page.page_hash is not None
            page = page.next_free
            n -= 1
        return count

    def get_all_free_pages(self) -> list[KVPage]:
        """Every free page from head (next to be evicted) to tail; O(n)."""
        out: list[KVPage] = []
        page = self._head.next_free
        tail = self._tail
        while page is not None and page is not tail:
            out.append(page)
            page = page.next_free
        return out

    def check(self) -> None:
        """Raise `InvariantViolation` unless the links, the count and the ends agree."""
        seen: set[int] = set()
        prev = self._head
        page = self._head.next_free
        while page is not self._tail:
            if page is None:
                raise InvariantViolation(
                    f"free queue broken after page {prev.page_id}: next_free is None"
                )
            if page.prev_free is not prev:
                raise InvariantViolation(
                    f"free queue page {page.page_id}: prev_free is not page {prev.page_id}"
                )
            if id(page) in seen:
                raise InvariantViolation(f"free queue holds page {page.page_id} twice")
            seen.add(id(page))
            prev, page = page, page.next_free
        if self._tail.prev_free is not prev:
            raise InvariantViolation("free queue tail does not point back at the last page")
        if len(seen) != self.num_free_pages:
            raise InvariantViolation(
                f"free queue counts {self.num_free_pages} pages but links {len(seen)}"
            )
