"""A slow peer: the pull hits its deadline, the server stops, the worker computes instead.

Real parts in one process: two `WorkerActor`s (pool, KV store, model, gRPC
server; no coordinator) and, in front of the first worker's page service, a
second real `TransferServer` with `page_delay_s` set: the slow peer. The
only stand-in is a counting proxy around that page service, to see how many
pages the server still exported after the client gave up.

The deadline bound (deadline + 100 ms) is the issue's contract for
cancellation, not a speed figure: it is checked on the median of three pulls,
so that one scheduling hiccup of a loaded machine does not decide it.
"""

from __future__ import annotations

import dataclasses
import random
import re
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from reliability_kit import in_process_worker, wait_until

from kvmesh.config import ClusterConfig, PoolConfig, TransferConfig
from kvmesh.errors import DeadlineExceeded
from kvmesh.requests import GenerateRequest, WorkerSpec
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.actor import WorkerActor
from kvmesh.worker.kv_store import PageBlob
from kvmesh.worker.page_service import PageService
from kvmesh.worker.transfer_client import SyncPeerClient
from kvmesh.worker.transfer_server import ServerThread

pytestmark = pytest.mark.timeout(120)

PAGE = 16
PAGES = 10
DELAY_S = 0.25  # per streamed page: 10 pages over 2 streams take ~1.25 s
DEADLINE_S = 0.5
SLACK_S = 0.1
BASE = dataclasses.replace(ClusterConfig(), pool=PoolConfig(num_pages=64))
PULLER = dataclasses.replace(
    BASE, transfer=TransferConfig(deadline_s=DEADLINE_S, retry_backoff_s=0.01)
)


class CountingService:
    """A real `PageService` seen through a proxy that counts the pages it exports."""

    def __init__(self, service: PageService) -> None:
        self._service = service
        self._lock = threading.Lock()
        self.exports = 0

    def export(self, page_id: Any) -> PageBlob:
        with self._lock:
            self.exports += 1
        return self._service.export(page_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)


@pytest.fixture(scope="module")
def owner() -> Iterator[WorkerActor]:
    with in_process_worker(WorkerSpec(WorkerId("owner"), BASE)) as worker:
        yield worker


@pytest.fixture(scope="module")
def puller() -> Iterator[WorkerActor]:
    with in_process_worker(WorkerSpec(WorkerId("puller"), PULLER)) as worker:
        yield worker


@pytest.fixture
def slow_peer(owner: WorkerActor) -> Iterator[tuple[ServerThread, CountingService]]:
    counting = CountingService(owner.pages)
    server = ServerThread(counting, BASE.transfer, page_delay_s=DELAY_S)  # type: ignore[arg-type]
    server.start()
    try:
        yield server, counting
    finally:
        server.stop()


_rng = random.Random(7)


def cached_prompt(owner: WorkerActor) -> tuple[list[int], list[PageHash]]:
    """A fresh prompt of PAGES full pages (plus a partial one) that `owner` now caches."""
    tokens = [_rng.randrange(256) for _ in range(PAGES * PAGE + 5)]
    owner.generate(GenerateRequest(f"seed-{_rng.random()}", tuple(tokens), 1))
    hashes = owner.hasher.hash_prompt(tokens)
    assert owner.pages.prefix_length(hashes) == PAGES
    return tokens, hashes


def all_unpinned(service: PageService) -> bool:
    return all(c == 0 for c in service.ref_counts())


def test_a_pull_from_a_slow_peer_fails_with_deadline_exceeded_and_the_request_is_computed(
    owner: WorkerActor,
    puller: WorkerActor,
    slow_peer: tuple[ServerThread, CountingService],
) -> None:
    server, counting = slow_peer
    tokens, hashes = cached_prompt(owner)
    request = GenerateRequest(
        "slow-1", tuple(tokens), 8, promised_pull=PAGES, peer_address=server.address
    )
    result = puller.generate(request)
    assert result.pull_error is not None
    assert result.pull_error.startswith("DeadlineExceeded")
    assert server.address in result.pull_error
    # Pages that landed whole before the deadline are used (and counted as pulled).
    assert result.pages_hit_local == 0 and result.pages_pulled < PAGES
    assert result.pages_pulled + result.pages_computed == PAGES + 1
    assert list(result.tokens) == puller.compute_from_scratch(tokens, 8)
    print(f"\npull gave up after {result.timings.pull_ms:.0f} ms (deadline {DEADLINE_S * 1e3:.0f})")
    # The puller's pool: every page pulled whole or computed by it, nothing held.
    puller.check_invariants()
    assert all_unpinned(puller.pages)
    assert puller.pages.prefix_length(hashes) == PAGES
    # The server dropped the cancelled streams: pins released, no page exported after.
    assert wait_until(lambda: all_unpinned(owner.pages), timeout_s=5.0)
    exported = counting.exports
    time.sleep(3 * DELAY_S)
    assert counting.exports == exported
    assert exported < PAGES


def test_the_deadline_holds_to_within_100_ms_and_names_the_peer(
    owner: WorkerActor, slow_peer: tuple[ServerThread, CountingService]
) -> None:
    server, _ = slow_peer
    _, hashes = cached_prompt(owner)
    overshoots: list[float] = []
    with SyncPeerClient(server.address, PULLER.transfer) as client:
        for _ in range(3):
            t0 = time.perf_counter()
            with pytest.raises(
                DeadlineExceeded, match=re.escape("raise TransferConfig.deadline_s")
            ) as err:
                client.fetch_pages(hashes)
            overshoots.append(time.perf_counter() - t0 - DEADLINE_S)
            assert server.address in str(err.value)
    print(f"\ndeadline overshoot (s): {[round(x, 4) for x in overshoots]}")
    assert min(overshoots) >= -0.01  # it did wait for the deadline, not fail early
    assert statistics.median(overshoots) <= SLACK_S
    assert wait_until(lambda: all_unpinned(owner.pages), timeout_s=5.0)


def test_a_peer_that_answers_in_time_is_pulled_from(
    owner: WorkerActor, puller: WorkerActor
) -> None:
    """The control: the same pull without the delay moves the pages (so the test above can fail)."""
    tokens, _ = cached_prompt(owner)
    request = GenerateRequest(
        "fast-1", tuple(tokens), 8, promised_pull=PAGES, peer_address=owner.address
    )
    result = puller.generate(request)
    assert result.pull_error is None
    assert result.pages_pulled == PAGES
    assert list(result.tokens) == puller.compute_from_scratch(tokens, 8)
