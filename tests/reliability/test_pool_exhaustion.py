"""Pool exhaustion: requests that cannot get pages wait or are refused clearly; nothing held is evicted.

Real workers in one process (`WorkerActor` without a coordinator: pool, KV
store, model, gRPC server) with a pool of 11 usable pages. What is promised:

- with one compute slot (the default) requests queue for it, so they wait
  and all succeed, however small the pool;
- with more slots than the pool can feed, the request that finds too few
  free pages is refused with `PoolExhausted` (saying to retry or grow the
  pool), the running request's pages are untouched, and the same request
  succeeds once pages are free again;
- a push (granted: the ticket of a request routed to the worker) into a
  pool whose every page is held is refused, over gRPC as the same
  `PoolExhausted`, and evicts nothing held (a push into a pool with a few
  free pages goes page by page through them, evicting only cached, unheld
  pages, its own earlier ones included, within the pusher's eviction
  budget);
- a prompt larger than the whole pool is refused before anything is taken.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from reliability_kit import TRANSFER, in_process_worker, wait_until

from kvmesh.config import ClusterConfig, PoolConfig
from kvmesh.errors import PoolExhausted
from kvmesh.requests import GenerateRequest, WorkerSpec
from kvmesh.types import WorkerId
from kvmesh.worker.actor import WorkerActor
from kvmesh.worker.transfer_client import SyncPeerClient

pytestmark = pytest.mark.timeout(180)

PAGE = 16
USABLE = 11
CONFIG = dataclasses.replace(ClusterConfig(), pool=PoolConfig(num_pages=USABLE + 1))
LONG_DECODE = 600  # keeps a request holding its pages for a while

_rng = random.Random(11)


def prompt(pages: int) -> tuple[int, ...]:
    """Exactly `pages` full pages of fresh tokens."""
    return tuple(_rng.randrange(256) for _ in range(pages * PAGE))


def spec(worker_id: str, max_concurrent: int) -> WorkerSpec:
    return WorkerSpec(WorkerId(worker_id), CONFIG, max_concurrent=max_concurrent)


@pytest.fixture(scope="module")
def two_slots() -> Iterator[WorkerActor]:
    with in_process_worker(spec("two-slots", 2)) as w:
        yield w


@pytest.fixture(scope="module")
def one_slot() -> Iterator[WorkerActor]:
    with in_process_worker(spec("one-slot", 1)) as w:
        yield w


def start_holding(worker: WorkerActor, tokens: tuple[int, ...]) -> tuple[Any, threading.Thread]:
    """Serve a long request in a thread; return once it holds its prompt's pages, cached."""
    box: dict[str, Any] = {}

    def run() -> None:
        box["result"] = worker.generate(GenerateRequest("holder", tokens, LONG_DECODE))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    need = len(tokens) // PAGE
    hashes = worker.hasher.hash_prompt(tokens)
    assert wait_until(
        lambda: worker.stats().pages_used >= need and worker.pages.prefix_length(hashes) == need,
        timeout_s=30.0,
    )
    return box, t


def test_a_request_that_finds_too_few_pages_is_refused_and_the_running_one_keeps_its_pages(
    two_slots: WorkerActor,
) -> None:
    held = prompt(8)
    box, holder = start_holding(two_slots, held)
    held_hashes = two_slots.hasher.hash_prompt(held)
    used_before = two_slots.stats().pages_used
    other = prompt(6)
    with pytest.raises(PoolExhausted, match="retry later or grow the pool") as err:
        two_slots.generate(GenerateRequest("late", other, 2))
    assert "needs 6 pages" in str(err.value)
    assert two_slots.stats().pages_used == used_before  # the refusal took nothing, freed nothing
    two_slots.check_invariants()
    holder.join(timeout=120)
    result = box["result"]
    assert list(result.tokens) == two_slots.compute_from_scratch(held, LONG_DECODE)
    assert two_slots.pages.prefix_length(held_hashes) == 8  # cached whole, evicted by nobody
    # Pages are free again: the refused request now goes through, with the right answer.
    again = two_slots.generate(GenerateRequest("late-again", other, 2))
    assert list(again.tokens) == two_slots.compute_from_scratch(other, 2)
    assert two_slots.stats().pages_used == 0
    assert two_slots.stats().errors == 1
    two_slots.check_invariants()


def test_with_one_compute_slot_requests_wait_for_pages_and_all_succeed(
    one_slot: WorkerActor,
) -> None:
    prompts = [prompt(8) for _ in range(4)]  # each needs 8 of the 11 pages
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(one_slot.generate, GenerateRequest(f"q{i}", p, 3))
            for i, p in enumerate(prompts)
        ]
        results = [f.result(timeout=120) for f in futures]
    for p, r in zip(prompts, results, strict=True):
        assert list(r.tokens) == one_slot.compute_from_scratch(p, 3)
    assert max(r.timings.queue_ms for r in results) > 0
    assert one_slot.stats().errors == 0
    assert one_slot.stats().pages_used == 0
    one_slot.check_invariants()


def test_a_push_into_a_pool_whose_pages_are_all_held_is_refused_and_evicts_nothing(
    one_slot: WorkerActor, two_slots: WorkerActor
) -> None:
    source_prompt = prompt(5)
    one_slot.generate(GenerateRequest("src", source_prompt, 1))
    src_hashes = one_slot.hasher.hash_prompt(source_prompt)
    with SyncPeerClient(one_slot.address, TRANSFER) as client:
        incoming = client.fetch_pages(src_hashes).pages
    assert len(incoming) == 5
    holder_tokens = prompt(USABLE)
    box, holder = start_holding(two_slots, holder_tokens)  # every page held
    assert two_slots.stats().pages_free == 0
    cached_before = two_slots.stats().cached_pages
    ticket = two_slots.expect_push(GenerateRequest("dst", source_prompt, 1))  # routed here
    with (
        SyncPeerClient(two_slots.address, TRANSFER) as client,
        pytest.raises(PoolExhausted, match=r"RESOURCE_EXHAUSTED.*0 of 11 are free"),
    ):
        client.push_pages(list(incoming), ticket)  # granted: refused for room, not for proof
    assert two_slots.pages.lookup(src_hashes) == [False] * 5
    assert two_slots.stats().cached_pages == cached_before  # nothing evicted to make room
    holder.join(timeout=120)
    held = box["result"]
    assert list(held.tokens) == two_slots.compute_from_scratch(holder_tokens, LONG_DECODE)
    assert two_slots.stats().cached_pages == USABLE  # the holder's pages, all still there
    two_slots.check_invariants()
    assert two_slots.stats().pages_used == 0


def test_a_prompt_larger_than_the_pool_is_refused_before_taking_anything(
    one_slot: WorkerActor,
) -> None:
    before = one_slot.stats()
    with pytest.raises(PoolExhausted, match="grow the pool"):
        one_slot.generate(GenerateRequest("huge", prompt(USABLE + 1), 1))
    after = one_slot.stats()
    assert (after.pages_used, after.cached_pages) == (0, before.cached_pages)
    one_slot.check_invariants()
