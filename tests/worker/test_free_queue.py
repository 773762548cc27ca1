"""The free page queue: a doubly linked list with fake head and tail."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidInput, InvariantViolation
from kvmesh.types import PageId
from kvmesh.worker.free_queue import FreePageQueue, KVPage


def make(n: int) -> tuple[list[KVPage], FreePageQueue]:
    pages = [KVPage(PageId(i)) for i in range(n)]
    return pages, FreePageQueue(pages)


def ids(q: FreePageQueue) -> list[int]:
    return [p.page_id for p in q.get_all_free_pages()]


def test_a_new_queue_lists_its_pages_in_order() -> None:
    _, q = make(5)
    assert ids(q) == [0, 1, 2, 3, 4]
    assert q.num_free_pages == len(q) == 5
    q.check()


def test_popleft_takes_the_head_and_unlinks_it() -> None:
    _, q = make(3)
    page = q.popleft()
    assert page.page_id == 0
    assert page.prev_free is None and page.next_free is None
    assert ids(q) == [1, 2]
    q.check()


def test_popleft_on_an_empty_queue_raises() -> None:
    _, q = make(0)
    with pytest.raises(InvalidInput, match="empty"):
        q.popleft()
    assert q.peek() is None


def test_popleft_n_takes_pages_in_order_and_relinks_the_head() -> None:
    _, q = make(6)
    taken = q.popleft_n(4)
    assert [p.page_id for p in taken] == [0, 1, 2, 3]
    assert all(p.prev_free is None and p.next_free is None for p in taken)
    assert ids(q) == [4, 5]
    q.check()


def test_popleft_n_of_every_page_empties_the_queue() -> None:
    _, q = make(3)
    assert [p.page_id for p in q.popleft_n(3)] == [0, 1, 2]
    assert q.num_free_pages == 0 and ids(q) == []
    q.check()
    q.append(KVPage(PageId(9)))
    assert ids(q) == [9]


def test_popleft_n_of_more_pages_than_free_raises_and_changes_nothing() -> None:
    _, q = make(3)
    with pytest.raises(InvalidInput, match="only 3 are free"):
        q.popleft_n(4)
    with pytest.raises(InvalidInput):
        q.popleft_n(-1)
    assert q.popleft_n(0) == []
    assert ids(q) == [0, 1, 2]
    q.check()


def test_remove_takes_a_page_out_of_the_middle() -> None:
    pages, q = make(5)
    q.remove(pages[2])
    assert ids(q) == [0, 1, 3, 4]
    assert pages[2].prev_free is None and pages[2].next_free is None
    q.remove(pages[0])
    q.remove(pages[4])
    assert ids(q) == [1, 3]
    q.check()


def test_removing_a_page_that_is_not_queued_raises() -> None:
    pages, q = make(2)
    q.remove(pages[0])
    with pytest.raises(InvalidInput, match="not in the free queue"):
        q.remove(pages[0])
    assert q.num_free_pages == 1


def test_remove_n_unlinks_every_page_given() -> None:
    pages, q = make(6)
    q.remove_n([pages[4], pages[1], pages[5]])
    assert ids(q) == [0, 2, 3]
    q.check()


def test_append_puts_a_page_at_the_tail() -> None:
    _, q = make(3)
    first = q.popleft()
    q.append(first)
    assert ids(q) == [1, 2, 0]
    q.check()


def test_appending_a_queued_page_raises() -> None:
    pages, q = make(3)
    with pytest.raises(InvalidInput, match="already in the free queue"):
        q.append(pages[1])
    assert ids(q) == [0, 1, 2]


def test_append_n_keeps_the_given_order() -> None:
    _, q = make(5)
    taken = q.popleft_n(3)
    q.append_n(list(reversed(taken)))
    assert ids(q) == [3, 4, 2, 1, 0]
    q.append_n([])
    assert q.num_free_pages == 5
    q.check()


def test_check_finds_a_broken_link() -> None:
    pages, q = make(4)
    pages[2].prev_free = pages[0]
    with pytest.raises(InvariantViolation, match="page 2"):
        q.check()


def test_check_finds_a_wrong_count() -> None:
    _, q = make(4)
    q.num_free_pages = 3
    with pytest.raises(InvariantViolation, match="counts 3 pages but links 4"):
        q.check()


def test_a_queued_page_prints_without_walking_the_list() -> None:
    pages, _ = make(1000)
    text = repr(pages[500])
    assert "page_id=500" in text and "next_free" not in text
