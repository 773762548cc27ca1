"""In-process workers with tiers (real gRPC, a real coordinator): the index follows every
move between tiers, a prefix evicted to host memory or disk is promoted, and a peer pulls
pages a worker keeps below its device pool."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_kit import BASE, HASHER, Prompts

from kvmesh.config import PoolConfig
from kvmesh.coordinator.service import Coordinator
from kvmesh.errors import InvalidSetting
from kvmesh.requests import WorkerSpec
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.actor import WorkerActor
from kvmesh.worker.model import TinyTransformer

_prompts = Prompts(11)
prompt, request = _prompts.prompt, _prompts.request


@pytest.fixture()
def coordinator() -> Coordinator:
    return Coordinator(BASE.coordinator)


@pytest.fixture()
def workers(tmp_path: Path, coordinator: Coordinator) -> Iterator[list[WorkerActor]]:
    """Two workers of 8 device pages, 4 host pages and a disk folder each."""
    made = []
    try:
        for i in range(2):
            pool = PoolConfig(
                num_pages=9,
                host_pages=4,
                disk_dir=str(tmp_path / f"w{i}"),
                disk_bytes=1 << 24,
                disk_fsync=False,
            )
            config = dataclasses.replace(BASE, pool=pool)
            made.append(WorkerActor(WorkerSpec(WorkerId(f"w{i}"), config), coordinator))
        yield made
    finally:
        for w in made:
            w.shutdown()


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(BASE.model)


def push_down(worker: WorkerActor, tokens: tuple[int, ...]) -> list[str | None]:
    """Serve `tokens`, then two 7-page prompts that push its pages below the device; returns
    the tier of each of its pages."""
    assert worker.tiers is not None
    worker.generate(request(tokens, 2))
    worker.generate(request(prompt(7), 2))
    worker.generate(request(prompt(7), 2))
    worker.tiers.flush()
    with worker.pages.lock:
        return [worker.tiers.tier_of(h) for h in HASHER.hash_prompt(tokens)]


def index_tiers(
    coordinator: Coordinator, worker: WorkerActor, tokens: tuple[int, ...]
) -> list[str]:
    holders = [coordinator.index.holders(PageHash(h)) for h in HASHER.hash_prompt(tokens)]
    return ["+".join(sorted(h.get(worker.worker_id, ()))) for h in holders]


def test_the_index_follows_pages_down_the_tiers_and_back(
    coordinator: Coordinator, workers: list[WorkerActor], model: TinyTransformer
) -> None:
    w0 = workers[0]
    first = prompt(5)
    where = push_down(w0, first)
    assert set(where) <= {"cpu", "disk"} and "disk" in where
    w0.flush()
    assert index_tiers(coordinator, w0, first) == where

    result = w0.generate(request(first, 3))
    assert (result.pages_hit_local, result.pages_computed) == (5, 1)
    assert list(result.tokens) == model.generate(list(first), 3)
    w0.flush()
    assert index_tiers(coordinator, w0, first) == ["gpu"] * 5


def test_a_peer_pulls_pages_a_worker_keeps_in_host_memory_and_on_disk(
    workers: list[WorkerActor], model: TinyTransformer
) -> None:
    w0, w1 = workers
    shared = prompt(5)
    assert set(push_down(w0, shared)) <= {"cpu", "disk"}
    result = w1.generate(request(shared, 4, promised_pull=5, peer_address=w0.address))
    assert (result.pages_pulled, result.pages_computed, result.pull_error) == (5, 1, None)
    assert list(result.tokens) == model.generate(list(shared), 4)


def test_a_restarted_worker_announces_the_disk_pages_it_adopted(
    tmp_path: Path, coordinator: Coordinator, model: TinyTransformer
) -> None:
    pool = PoolConfig(num_pages=9, disk_dir=str(tmp_path), disk_bytes=1 << 24, disk_fsync=True)
    config = dataclasses.replace(BASE, pool=pool)
    first = prompt(5)
    worker = WorkerActor(WorkerSpec(WorkerId("w-disk"), config), coordinator)
    try:
        where = push_down(worker, first)
    finally:
        worker.shutdown()
    assert set(where) == {"disk"}

    again = WorkerActor(WorkerSpec(WorkerId("w-disk"), config), coordinator)
    try:
        again.flush()
        assert index_tiers(coordinator, again, first) == ["disk"] * 5
        result = again.generate(request(first, 3))
        assert (result.pages_hit_local, result.pages_computed) == (5, 1)
        assert list(result.tokens) == model.generate(list(first), 3)
    finally:
        again.shutdown()


def test_a_tierless_cpu_workers_pages_are_indexed_on_the_device_tier(
    coordinator: Coordinator,
) -> None:
    # A CPU worker's pool is its device pool: were its pages indexed in the host tier
    # ("cpu"), kv_aware would charge every local hit a promotion it never makes.
    config = dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, device="cpu"))
    worker = WorkerActor(WorkerSpec(WorkerId("w-cpu"), config), coordinator)
    try:
        assert worker.tiers is None and worker.store.device.type == "cpu"
        tokens = prompt(4)
        worker.generate(request(tokens, 2))
        worker.flush()
        assert index_tiers(coordinator, worker, tokens) == ["gpu"] * 4
        hashes = [PageHash(h) for h in HASHER.hash_prompt(tokens)]
        matched = coordinator.index.match(hashes)
        assert matched.pages[worker.worker_id] == 4
        assert coordinator.index.tier_pages(hashes, matched) == {}  # nothing to promote
    finally:
        worker.shutdown()


@pytest.mark.parametrize("medium", ["cpu", "host", "disk"])
def test_a_device_pool_naming_a_lower_tier_is_refused(medium: str) -> None:
    with pytest.raises(InvalidSetting, match="must name the device tier") as err:
        PoolConfig(medium=medium)
    assert "PoolConfig.medium" in str(err.value)
