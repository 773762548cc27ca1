"""``kv_mesh`` knows what each engine's kvmesh store holds, not only the engine's own cache.

A store keeps every block its engine saved long after the engine's own
cache evicted it, and the engine loads those blocks through kvmesh's
connector. The stores publish their blocks as vLLM KV events in the host
tier (`kvmesh.worker.store_events`); the gateway follows them beside the
engines' own events, so a block held only in engine A's store is predicted
as a store load on A (``host_hit_cost`` a block) and as a pull on B
(``pull_cost``), and the decision record says so.

The router tests feed the index as the stores' events would; the last ones
run the whole path: real `EngineStore`s saving proven blocks, real
publishers on loopback ZMQ, the gateway built from its CLI flags with its
subscriber, and fake engines behind it over HTTP (the test is about the
gateway; tests/engines/ run real vLLM engines).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from gateway_kit import BLOCK, MODEL, FakeEngine, serve

from kvmesh.app.cli import build_parser
from kvmesh.config import CoordinatorConfig
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.coordinator.policies import RouteRequest
from kvmesh.engine_launcher import local_endpoint
from kvmesh.engine_subscriber import EngineSubscriber
from kvmesh.errors import ConfigError
from kvmesh.events import AllPagesCleared, PagesStored, make_batch
from kvmesh.gateway.app import STORE_HEADER, Gateway, create_app
from kvmesh.gateway.command import build_gateway, describe
from kvmesh.gateway.config import EngineTarget, store_worker_id
from kvmesh.gateway.routing import MeshHeld, MeshRouter, make_router
from kvmesh.load import WorkerLoad
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker.engine_store import BlockRun, EngineStore
from kvmesh.worker.store_events import StoreEventPublisher, publish_store_events
from tests.async_kit import until

A, B = WorkerId("engine-a"), WorkerId("engine-b")
STORES = {A: store_worker_id(A), B: store_worker_id(B)}
HASHES = [PageHash(bytes([i]) * 8) for i in range(1, 21)]  # a 20-block prompt
SIZE = 32


def index_with(*held: tuple[WorkerId, int, str | None]) -> GlobalIndex:
    """An index where each (worker, blocks, medium) holds the prompt's first blocks; both
    engines and both stores have sent a batch."""
    index = GlobalIndex()
    given = {w: (n, medium) for w, n, medium in held}
    for worker in (A, B, *STORES.values()):
        n, medium = given.get(worker, (0, None))
        events = [PagesStored(tuple(HASHES[:n]), None, (), SIZE, None, medium)] if n else []
        index.apply(make_batch(events, worker, "life", 0))
    return index


def request() -> RouteRequest:
    return RouteRequest(HASHES, len(HASHES) * SIZE + 5, page_size=SIZE)


def loads(queued_a: int = 0) -> list[WorkerLoad]:
    return [WorkerLoad(A, active_prefill_tokens=queued_a), WorkerLoad(B)]


def test_a_block_only_in_an_engines_store_is_a_store_load_there_and_a_pull_elsewhere() -> None:
    index = index_with((STORES[A], 20, "CPU"))
    router = make_router("kv_mesh", index, CoordinatorConfig(), stores=STORES)
    held = router.overlaps(request())
    assert isinstance(held, MeshHeld)
    assert dict(held) == {A: 20} and held.from_store == {A: 20}
    idle = router.choose(request(), held, loads(), b"k")
    # A loads 20 blocks at 0.034 each, B would pull them at 0.16: A
    assert (idle.worker_id, idle.local_pages, idle.promote_pages) == (A, 20, 20)
    assert idle.peer_id is None
    busy = router.choose(request(), held, loads(queued_a=12 * SIZE), b"k")
    # with 12 blocks of prefill queued on A, B pulls the 20 blocks from A's store
    assert (busy.worker_id, busy.local_pages, busy.promote_pages) == (B, 0, 0)
    assert (busy.peer_id, busy.peer_pages) == (A, 20)


def test_the_store_counts_only_beyond_the_engines_own_cache() -> None:
    index = index_with((A, 5, None), (STORES[A], 20, "CPU"), (STORES[B], 3, "CPU"))
    router = make_router("kv_mesh", index, CoordinatorConfig(), stores=STORES)
    held = router.overlaps(request())
    assert dict(held) == {A: 20, B: 3}
    assert held.from_store == {A: 15, B: 3}
    decision = router.choose(request(), held, loads(), b"k")
    assert (decision.worker_id, decision.local_pages, decision.promote_pages) == (A, 20, 15)


def test_a_store_is_not_priced_as_free_a_device_hit_wins_over_a_store_load() -> None:
    index = index_with((A, 20, None), (STORES[B], 20, "CPU"))
    router = make_router("kv_mesh", index, CoordinatorConfig(), stores=STORES)
    decision = router.choose(request(), router.overlaps(request()), loads(), b"k")
    assert (decision.worker_id, decision.promote_pages) == (A, 0)


def test_a_stale_store_or_a_store_of_a_stale_engine_counts_nothing() -> None:
    index = index_with((STORES[A], 20, "CPU"))
    router = make_router("kv_mesh", index, CoordinatorConfig(), stores=STORES)
    index.mark_stale(STORES[A])
    assert dict(router.overlaps(request())) == {}
    index = index_with((STORES[A], 20, "CPU"))
    router = make_router("kv_mesh", index, CoordinatorConfig(), stores=STORES)
    index.mark_stale(A)
    assert dict(router.overlaps(request())) == {}


def test_without_stores_or_under_kv_aware_a_store_is_no_cache_of_the_engine() -> None:
    index = index_with((STORES[A], 20, "CPU"))
    mesh = make_router("kv_mesh", index, CoordinatorConfig())  # no stores given
    assert dict(mesh.overlaps(request())) == {STORES[A]: 20}
    assert mesh.choose(request(), {A: 0}, loads(), b"k").promote_pages == 0
    plain = make_router("kv_aware", index, CoordinatorConfig(), stores=STORES)
    assert plain.choose(request(), plain.overlaps(request()), loads(), b"k").local_pages == 0


def test_store_flags_pair_with_engines_and_a_replay_needs_its_events(tokenizer_dir: Path) -> None:
    base = ["gateway", "--engine", "http://127.0.0.1:8001", "--tokenizer", str(tokenizer_dir)]
    parser = build_parser()
    with pytest.raises(ConfigError, match="--store-replay needs --store-events"):
        build_gateway(parser.parse_args([*base, "--store-replay", "tcp://127.0.0.1:9"]))
    with pytest.raises(ConfigError, match="--store-events was given 2 times for 1 --engine"):
        build_gateway(parser.parse_args([*base, "--store-events", "tcp://127.0.0.1:9",
                                         "--store-events", "tcp://127.0.0.1:8"]))  # fmt: skip
    with pytest.raises(ConfigError, match="must not end in '/store'"):
        EngineTarget("e/store", "http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="needs the store's events endpoint"):
        EngineTarget("e", "http://127.0.0.1:1", store_replay="tcp://127.0.0.1:9")


def test_the_flags_give_kv_mesh_each_engines_store_and_one_subscriber_for_all(
    tokenizer_dir: Path,
) -> None:
    argv = ["gateway", "--policy", "kv_mesh", "--tokenizer", str(tokenizer_dir),
            "--engine", "http://127.0.0.1:8001", "--engine", "http://127.0.0.1:8002",
            "--events", "tcp://127.0.0.1:5557", "--events", "tcp://127.0.0.1:5567",
            "--store-events", "tcp://127.0.0.1:7101", "--store-events", "tcp://127.0.0.1:7111",
            "--store-replay", "tcp://127.0.0.1:7102", "--store-replay", "tcp://127.0.0.1:7112"]  # fmt: skip
    gateway = build_gateway(build_parser().parse_args(argv))
    assert isinstance(gateway.router, MeshRouter)
    assert gateway.router.stores == {"engine-0": "engine-0/store", "engine-1": "engine-1/store"}
    (subscriber,) = gateway.sources
    assert isinstance(subscriber, EngineSubscriber)
    assert subscriber.engines() == ["engine-0", "engine-0/store", "engine-1", "engine-1/store"]
    line = describe(gateway, "127.0.0.1", 8000)
    assert "engine-1=http://127.0.0.1:8002 (events tcp://127.0.0.1:5567) (store events " in line


# ---------------------------------------------------------------- the whole path


@dataclass
class StoreSide:
    """One engine's store: the store, its publisher, and the flags the gateway gets."""

    store: EngineStore
    publisher: StoreEventPublisher


@dataclass
class MeshSetup:
    gateway: Gateway
    url: str
    stores: dict[str, StoreSide]


def save_prompt(store: EngineStore, gateway: Gateway, tokens: list[int]) -> list[PageHash]:
    """Save `tokens`' full blocks as the engine's connector would; their index names."""
    hashed = gateway.hasher.hash_blocks(tokens)
    n = len(hashed.digests)
    digests = tuple(PageHash(d) for d in hashed.digests)
    run = BlockRun(None, digests, tuple(tokens[: n * BLOCK]), (None,) * n)
    store.save(run, [bytes([i]) * (2 * BLOCK * 8) for i in range(n)])
    return list(hashed.page_hashes)


@asynccontextmanager
async def mesh_gateway(tokenizer_dir: Path) -> AsyncIterator[MeshSetup]:
    """Two fake engines, a real store with a publisher beside each, the gateway from its
    flags (``--policy kv_mesh --store-events ... --store-replay ...``)."""
    async with AsyncExitStack() as stack:
        argv = ["gateway", "--tokenizer", str(tokenizer_dir), "--block-size", str(BLOCK),
                "--policy", "kv_mesh"]  # fmt: skip
        stores: dict[str, StoreSide] = {}
        for name in (A, B):
            engine = FakeEngine(name, cached=0)
            served = await serve(engine.app())
            stack.push_async_callback(served.stop)
            events = local_endpoint(f"{name}-events")
            replay = local_endpoint(f"{name}-replay")
            store = EngineStore(page_bytes=2 * BLOCK * 8, block_size=BLOCK, name=f"{name}-store")
            publisher = stack.enter_context(StoreEventPublisher(events, replay, name=name))
            publish_store_events(store, publisher)
            stores[name] = StoreSide(store, publisher)
            argv += ["--engine", served.url, "--name", name,
                     "--store-events", events, "--store-replay", replay]  # fmt: skip
        gateway = build_gateway(build_parser().parse_args(argv))
        front = await serve(create_app(gateway))
        stack.push_async_callback(front.stop)
        yield MeshSetup(gateway, front.url, stores)


async def joined(setup: MeshSetup, client: httpx.AsyncClient) -> None:
    """Until the gateway follows both stores (a ZMQ subscriber misses what is sent while it
    joins; the stores are empty, so a probe saying so is the truth)."""
    while True:
        engines = (await client.get(setup.url + "/health")).json()["engines"]
        if all(e["store_events_seq"] >= 0 and not e["stale"] for e in engines.values()):
            return
        for side in setup.stores.values():
            side.publisher.publish([AllPagesCleared()])
        await asyncio.sleep(0.05)


@pytest.mark.anyio
async def test_the_gateway_predicts_a_store_load_on_the_holder_and_a_pull_on_the_other(
    tokenizer_dir: Path,
) -> None:
    async with mesh_gateway(tokenizer_dir) as setup, httpx.AsyncClient(timeout=10) as client:
        await joined(setup, client)
        tokens = list(range(7, 7 + 5 * BLOCK + 2))  # 5 full blocks and a tail
        names = save_prompt(setup.stores[A].store, setup.gateway, tokens)
        index = setup.gateway.index
        await until(lambda: index.match(names).pages.get(STORES[A], 0) == 5, "A's store blocks")
        body = {"model": MODEL, "prompt": tokens, "max_tokens": 1}

        first = await client.post(setup.url + "/v1/completions", json=body)
        assert first.status_code == 200
        assert first.headers["x-kvmesh-engine"] == A
        assert (
            first.headers[STORE_HEADER] == "5" and first.headers["x-kvmesh-matched-blocks"] == "0"
        )
        record = setup.gateway.decisions.get(int(first.headers["x-kvmesh-decision"]))
        assert record is not None
        assert (record.engine, record.predicted_blocks, record.store_blocks) == (A, 0, 5)
        assert record.store_overlaps == {A: 5} and record.predicted_total == 5

        # A busy: the other engine pulls the blocks from A's store
        setup.gateway.pool[A].inflight_prefill_tokens = 100 * BLOCK
        second = await client.post(setup.url + "/v1/completions", json=body)
        assert second.headers["x-kvmesh-engine"] == B
        assert second.headers["x-kvmesh-pull-from"] == A
        assert second.headers["x-kvmesh-pull-blocks"] == "5" and second.headers[STORE_HEADER] == "0"
        record = setup.gateway.decisions.get(int(second.headers["x-kvmesh-decision"]))
        assert record is not None
        assert (record.store_blocks, record.pull_blocks, record.predicted_total) == (0, 5, 5)
        setup.gateway.pool[A].inflight_prefill_tokens = 0

        # the store evicts nothing here, but forgets: the prediction follows it
        setup.stores[A].store.forget(
            [PageHash(setup.gateway.hasher.hash_blocks(tokens).digests[2])]
        )
        await until(lambda: index.match(names).pages.get(STORES[A], 0) == 2, "the forgotten block")
        third = await client.post(setup.url + "/v1/completions", json=body)
        assert third.headers["x-kvmesh-engine"] == A and third.headers[STORE_HEADER] == "2"
        health = (await client.get(setup.url + "/health")).json()["engines"][A]
        assert health["store_blocks"] == 4 and health["blocks"] == 0
