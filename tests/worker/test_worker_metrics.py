"""A worker counts in named metrics (kvmesh.metrics), and its stats read them back."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest

from kvmesh import metrics
from kvmesh.config import PoolConfig
from kvmesh.coordinator.service import Coordinator
from kvmesh.errors import InvalidInput
from kvmesh.requests import GenerateRequest, WorkerSpec
from kvmesh.types import WorkerId
from kvmesh.worker.actor import WorkerActor
from tests.worker.worker_kit import BASE, Prompts

_prompts = Prompts(23)
prompt, request = _prompts.prompt, _prompts.request
_ids = itertools.count()


@pytest.fixture()
def pair() -> Iterator[tuple[WorkerActor, WorkerActor]]:
    """Two workers with ids no other test uses (the metrics are the process's)."""
    coordinator = Coordinator(BASE.coordinator)
    n = next(_ids)
    made = [
        WorkerActor(WorkerSpec(WorkerId(f"metrics-{n}-{i}"), BASE), coordinator) for i in range(2)
    ]
    try:
        yield made[0], made[1]
    finally:
        for w in made:
            w.shutdown()


def test_requests_and_their_prompt_pages_by_source_are_counted(
    pair: tuple[WorkerActor, WorkerActor],
) -> None:
    w0, _ = pair
    tokens = prompt(4)
    w0.generate(request(tokens))
    w0.generate(request(tokens))
    me = w0.worker_id
    assert metrics.WORKER_REQUESTS.value(worker=me) == 2
    by_source = metrics.PROMPT_PAGES.values_by("source", worker=me)
    assert by_source == {"local": 4, "pulled": 0, "computed": 6}
    stats = w0.stats()
    assert (stats.requests, stats.pages_hit_local, stats.prompt_pages) == (2, 4, 10)


def test_errors_are_counted_by_kind_and_shown_in_stats(
    pair: tuple[WorkerActor, WorkerActor],
) -> None:
    w0, _ = pair
    with pytest.raises(InvalidInput):
        w0.generate(GenerateRequest("empty", (), 1))
    assert metrics.WORKER_ERRORS.values_by("kind", worker=w0.worker_id) == {"InvalidInput": 1}
    assert w0.stats().errors == 1


def test_a_pull_counts_its_bytes_and_time_under_the_transport_that_delivered_it(
    pair: tuple[WorkerActor, WorkerActor],
) -> None:
    w0, w1 = pair
    shared = prompt(6)
    w0.generate(request(shared))
    result = w1.generate(request(shared + prompt(1), promised_pull=6, peer_address=w0.address))
    assert result.pages_pulled == 6
    me = {"worker": w1.worker_id, "direction": "pull", "transport": "grpc"}
    assert metrics.TRANSFER_BYTES.value(**me) == 6 * w1.store.page_nbytes
    assert metrics.TRANSFER_SECONDS.value(**me) == 1
    assert metrics.TRANSFER_SECONDS.histogram_sum(**me) > 0


def test_the_pool_gauges_follow_the_pool_at_each_report(
    pair: tuple[WorkerActor, WorkerActor],
) -> None:
    w0, _ = pair
    w0.generate(request(prompt(3)))
    w0.flush()
    gauges = metrics.POOL_PAGES.values_by("state", worker=w0.worker_id, tier=w0.pool.medium)
    stats = w0.stats()
    assert gauges == {
        "used": stats.pages_used,
        "free": stats.pages_free,
        "cached": stats.cached_pages,
    }
    assert gauges["cached"] == 3


def test_evictions_are_counted_per_tier_and_tenant_without_tiers() -> None:
    small = dataclasses.replace(BASE, pool=PoolConfig(num_pages=9))
    worker = WorkerActor(WorkerSpec(WorkerId(f"metrics-evict-{next(_ids)}"), small))
    try:
        for _ in range(3):
            worker.generate(request(prompt(4), 1))  # 5 pages each in a pool of 8
        evicted = metrics.TIER_EVICTIONS.value(worker=worker.worker_id, tier=worker.pool.medium)
        assert evicted > 0
        assert evicted == 3 * 4 - worker.pool.num_cached_hashes()  # every page not cached now
    finally:
        worker.shutdown()


def test_reset_cache_restarts_the_stats_while_the_exported_counters_keep_counting(
    pair: tuple[WorkerActor, WorkerActor],
) -> None:
    w0, _ = pair
    w0.generate(request(prompt(2)))
    w0.reset_cache()
    assert w0.stats().requests == 0
    w0.generate(request(prompt(2)))
    assert w0.stats().requests == 1
    assert metrics.WORKER_REQUESTS.value(worker=w0.worker_id) == 2
