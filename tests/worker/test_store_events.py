"""A store's page events as vLLM KV events, followed by kvmesh's own engine subscriber.

Real pieces throughout: an in-process `EngineStore` saving proven blocks
(its page and control servers are not needed for saves), a
`StoreEventPublisher` on real ZMQ sockets (loopback TCP, ipc), and the
gateway's `EngineSubscriber` feeding a `GlobalIndex`, which must end up
holding exactly what the store holds, in the host tier, under the names the
engine's own events use (a digest's low 8 bytes).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmesh.connector.blocks import block_run
from kvmesh.connector.store_client import StoreClient
from kvmesh.connector.store_launcher import StoreProcess
from kvmesh.coordinator.index import GlobalIndex
from kvmesh.engine_events import decode_engine_payload
from kvmesh.engine_hash import EngineHasher
from kvmesh.engine_launcher import free_port
from kvmesh.engine_subscriber import EngineEventsEndpoint, EngineSubscriber, SubscriberConfig
from kvmesh.errors import ConfigError, InvariantViolation
from kvmesh.events import AllPagesCleared, PagesRemoved, PagesStored
from kvmesh.metrics import counter_value
from kvmesh.types import PageHash, WorkerId
from kvmesh.worker import store_events
from kvmesh.worker.engine_store import BlockRun, EngineStore
from kvmesh.worker.store_events import (
    StoreEventPublisher,
    block_name,
    encode_store_batch,
    publish_store_events,
)
from tests.async_kit import until

B = 4
PAGE_BYTES = 2 * B * 8
HASHER = EngineHasher("sha256", B)  # int names, as the engine's events (vLLM's default)
STORE = WorkerId("engine-0/store")
BOUND_S = 10.0


def prompt(seed: int, blocks: int) -> tuple[BlockRun, list[PageHash]]:
    """A run of `blocks` full blocks and the names the engine's events give them."""
    tokens = [seed * 1000 + i for i in range(blocks * B)]
    hashed = HASHER.hash_blocks(tokens)
    run = BlockRun(None, tuple(PageHash(d) for d in hashed.digests), tuple(tokens),
                   (None,) * blocks)  # fmt: skip
    return run, list(hashed.page_hashes)


def save(store: EngineStore, run: BlockRun) -> None:
    store.save(run, [bytes([i]) * PAGE_BYTES for i in range(len(run.digests))])


def held(index: GlobalIndex, wid: WorkerId = STORE) -> frozenset[PageHash]:
    return index.worker_pages(wid) if wid in index.workers() else frozenset()


async def joined(publisher: StoreEventPublisher, sub: EngineSubscriber) -> None:
    """Until a batch crossed the wire: a ZMQ subscriber misses what is sent while it joins
    (the next batch's seq shows that gap, and replay heals it; a test waits instead).
    The probe says the store is empty, which it is when a scenario starts."""
    while sub.stream_state(STORE).last_seq < 0:
        publisher.publish([AllPagesCleared()])
        await asyncio.sleep(0.05)


def loopback_endpoints() -> tuple[str, str]:
    """Fresh loopback addresses for a store's events and its replay socket."""
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


@asynccontextmanager
async def subscribed(
    index: GlobalIndex, endpoint: str, replay: str | None = None
) -> AsyncIterator[EngineSubscriber]:
    """A started subscriber feeding `index` from the store's stream, stopped on the way out
    (short replay bounds: a test's gaps are healed or given up on within its bound)."""
    sub = EngineSubscriber(
        index,
        [EngineEventsEndpoint(str(STORE), endpoint, replay)],
        config=SubscriberConfig(replay_timeout_s=2.0, replay_idle_s=0.2),
    )
    await sub.start()
    try:
        yield sub
    finally:
        await sub.stop()


@dataclass(frozen=True, slots=True)
class Followed:
    """A scenario's pieces: a store, the index its started subscriber feeds, and the
    addresses the subscriber follows (events, replay)."""

    store: EngineStore
    index: GlobalIndex
    sub: EngineSubscriber
    endpoint: str
    replay: str

    @contextmanager
    def publishing(self, store: EngineStore | None = None) -> Iterator[StoreEventPublisher]:
        """A started publisher on the followed addresses, carrying `store`'s page events
        (this scenario's store unless another is given: a restarted one)."""
        with StoreEventPublisher(self.endpoint, self.replay, name="store-0") as publisher:
            publish_store_events(store or self.store, publisher)
            yield publisher


Scenario = Callable[[Followed], Awaitable[None]]


def follow(scenario: Scenario, *, pages: int = 16) -> None:
    """A store publishing to a subscriber bound on a fresh loopback port, with replay."""
    endpoint, replay = loopback_endpoints()
    index = GlobalIndex()
    store = EngineStore(page_bytes=PAGE_BYTES, block_size=B, num_pages=pages, name="store-0")

    async def main() -> None:
        async with subscribed(index, endpoint, replay) as sub:
            await scenario(Followed(store, index, sub, endpoint, replay))

    asyncio.run(asyncio.wait_for(main(), 3 * BOUND_S))


# ---------------------------------------------------------------- encoding


def test_a_batch_decodes_with_the_engines_decoder_as_host_tier_events_in_engine_names() -> None:
    run, names = prompt(1, 3)
    digests = run.digests
    events = [
        PagesStored(digests[:2], None, tuple(run.tokens[: 2 * B]), B),
        PagesStored(digests[2:], digests[1], tuple(run.tokens[2 * B :]), B),
        PagesRemoved(digests[:1]),
        AllPagesCleared(),
    ]
    batch = decode_engine_payload(encode_store_batch(events, 12.5))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    first, second, gone, cleared = batch.events
    assert isinstance(first, PagesStored) and isinstance(second, PagesStored)
    assert list(first.page_hashes) == names[:2] and first.parent_hash is None
    assert list(second.page_hashes) == names[2:] and second.parent_hash == names[1]
    assert first.token_ids == run.tokens[: 2 * B] and first.medium == "CPU"
    assert isinstance(gone, PagesRemoved) and list(gone.page_hashes) == names[:1]
    assert gone.medium == "CPU" and isinstance(cleared, AllPagesCleared)


def test_block_names_are_the_digests_low_8_bytes_big_endian_or_the_whole_digest() -> None:
    digest = PageHash(bytes(range(32)))
    assert block_name(digest) == int.from_bytes(bytes(range(24, 32)), "big")
    assert block_name(digest, int_hashes=False) == bytes(range(32))
    whole = decode_engine_payload(
        encode_store_batch([PagesRemoved((digest,))], 1.0, int_hashes=False)
    )
    assert whole.events == (PagesRemoved((digest,), "CPU"),)


def test_a_stored_event_without_its_token_ids_is_refused_not_published_half_true() -> None:
    run, _ = prompt(2, 2)
    with pytest.raises(InvariantViolation, match="event_token_ids"):
        encode_store_batch([PagesStored(run.digests, None, (), B)], 1.0)


def test_bad_endpoints_and_flags_are_config_errors_naming_what_to_give() -> None:
    with pytest.raises(ConfigError, match="tcp://, ipc://"):
        StoreEventPublisher("http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="tcp://, ipc://"):
        StoreEventPublisher("tcp://127.0.0.1:1", "127.0.0.1:2")
    port = free_port()
    taken = StoreEventPublisher("tcp://127.0.0.1:1", f"tcp://127.0.0.1:{port}")
    with taken, pytest.raises(ConfigError, match="cannot open its event sockets"):
        StoreEventPublisher("tcp://127.0.0.1:1", f"tcp://127.0.0.1:{port}").start()
    parser = argparse.ArgumentParser()
    store_events.add_arguments(parser)
    store = EngineStore(page_bytes=PAGE_BYTES, block_size=B)
    with pytest.raises(ConfigError, match="--events-replay needs --events"):
        store_events.attach(store, parser.parse_args(["--events-replay", "tcp://127.0.0.1:9"]))
    assert store_events.attach(store, parser.parse_args([])) is None
    assert store.on_events is None


# ---------------------------------------------------------------- followed by the subscriber


def test_the_index_holds_what_the_store_saved_pulled_evicted_and_forgot() -> None:
    async def scenario(case: Followed) -> None:
        with case.publishing() as publisher:
            await joined(publisher, case.sub)
            a, a_names = prompt(1, 3)
            save(case.store, a)
            await until(lambda: held(case.index) == frozenset(a_names), "the first run")
            match = case.index.match(a_names)
            assert match.pages == {STORE: 3} and match.tiers[STORE] == ("cpu",)
            b, b_names = prompt(2, 3)
            save(case.store, b)
            await until(lambda: held(case.index) == frozenset(a_names + b_names), "the second run")
            case.store.forget([b.digests[2]])
            await until(lambda: b_names[2] not in held(case.index), "the forgotten block")
            assert case.index.match(b_names).pages == {STORE: 2}
            assert held(case.index) == frozenset(a_names + b_names[:2])
        assert not case.index.is_stale(STORE)

    follow(scenario)


def test_blocks_the_store_evicts_leave_the_index() -> None:
    async def scenario(case: Followed) -> None:
        with case.publishing() as publisher:
            await joined(publisher, case.sub)
            a, a_names = prompt(1, 3)
            b, b_names = prompt(2, 3)
            save(case.store, a)
            save(case.store, b)  # 3 usable pages: a's blocks go
            await until(lambda: held(case.index) == frozenset(b_names), "b replacing a")
            assert case.index.match(a_names).pages == {}
            assert counter_value("kvmesh_store_event_batches", store="store-0",
                                 outcome="published") >= 2  # fmt: skip

    follow(scenario, pages=4)


def test_a_gateway_that_joins_late_replays_what_the_store_published_before() -> None:
    async def scenario(case: Followed) -> None:
        await case.sub.stop()  # not listening: the first batches are lost on the wire
        with case.publishing() as publisher:
            a, a_names = prompt(1, 3)
            save(case.store, a)
            await until(lambda: publisher.buffered() != [], "the first batch")
            await case.sub.start()
            b, b_names = prompt(2, 2)
            while case.sub.stream_state(STORE).last_seq < 0:  # a live batch shows the gap
                save(case.store, b)
                case.store.forget(list(b.digests))
                await asyncio.sleep(0.05)
            save(case.store, b)
            want = frozenset(a_names + b_names)
            await until(lambda: held(case.index) == want and not case.index.is_stale(STORE),
                        "the replayed and live batches")  # fmt: skip

    follow(scenario)


def test_a_subscriber_that_joins_after_a_lone_batch_is_told_where_the_stream_is() -> None:
    async def scenario(case: Followed) -> None:
        await case.sub.stop()
        with case.publishing() as publisher:
            a, a_names = prompt(1, 3)
            save(case.store, a)  # sent to no one: the store publishes nothing after it
            await case.sub.start()  # its subscription gets an empty batch: the gap shows,
            # and replay heals it
            await until(lambda: held(case.index) == frozenset(a_names), "the lone batch, replayed")
            assert len(publisher.buffered()) >= 2  # the batch and the join marker

    follow(scenario)


def test_a_restarted_store_drops_the_old_lifes_blocks_though_its_first_batches_were_lost() -> None:
    async def scenario(case: Followed) -> None:
        a, a_names = prompt(1, 3)
        with case.publishing() as publisher:
            await joined(publisher, case.sub)
            save(case.store, a)
            await until(lambda: held(case.index) == frozenset(a_names), "the first life")
            last = case.sub.stream_state(STORE).last_seq
        fresh = EngineStore(page_bytes=PAGE_BYTES, block_size=B, num_pages=16, name="store-0")
        b, b_names = prompt(2, 2)
        with case.publishing(fresh) as publisher:
            assert publisher.publish([AllPagesCleared()]) > last  # a new life counts on
            save(fresh, b)
            while case.sub.stream_state(STORE).last_seq <= last:  # the first ones may be lost
                fresh.forget(list(b.digests))
                save(fresh, b)
                await asyncio.sleep(0.05)
            await until(lambda: held(case.index) == frozenset(b_names), "the second life only")
            assert case.index.match(a_names).pages == {}

    follow(scenario)


def test_a_store_publishes_on_ipc_where_it_binds_and_the_subscriber_connects(
    tmp_path: Path,
) -> None:
    endpoint = f"ipc://{tmp_path}/store-events"
    index = GlobalIndex()
    store = EngineStore(page_bytes=PAGE_BYTES, block_size=B, num_pages=16, name="store-ipc")

    async def main() -> None:
        with StoreEventPublisher(endpoint, name="store-ipc") as publisher:
            publish_store_events(store, publisher)
            async with subscribed(index, endpoint) as sub:
                await joined(publisher, sub)
                a, a_names = prompt(3, 2)
                save(store, a)
                await until(lambda: held(index) == frozenset(a_names), "the ipc stream")

    asyncio.run(asyncio.wait_for(main(), 3 * BOUND_S))


def test_a_store_process_started_with_events_flags_publishes_what_its_engine_saves() -> None:
    """The store as engines get it (`StoreProcess`, ``--events``/``--events-replay``): blocks
    saved through its control API reach the index; a restart (empty) takes them out."""
    endpoint, replay = loopback_endpoints()
    index = GlobalIndex()
    process = StoreProcess(block_nbytes=64, block_size=B, pages=16, name="store-proc",
                           events=endpoint, events_replay=replay)  # fmt: skip
    assert process.command()[-4:] == ["--events", endpoint, "--events-replay", replay]

    def save_through(client: StoreClient, seed: int) -> list[PageHash]:
        run, names = prompt(seed, 2)
        wire = block_run(list(run.digests), list(run.tokens), [None, None], 0, 2, B)
        client.save(wire, [bytes(process.page_bytes)] * 2)
        return names

    async def main() -> None:
        async with subscribed(index, endpoint, replay) as sub:
            try:
                process.start()
                client = StoreClient(process.page_address, process.control_address)
                first = save_through(client, 1)
                while sub.stream_state(STORE).last_seq < 0:  # the PUB socket's first batch is
                    client.forget([bytes(d) for d in prompt(1, 2)[0].digests])  # lost while it
                    first = save_through(client, 1)  # connects: go on until one arrives
                    await asyncio.sleep(0.05)
                await until(lambda: held(index) == frozenset(first), "the saved blocks")
                client.close()
                process.restart()
                client = StoreClient(process.page_address, process.control_address)
                second = save_through(client, 2)
                while first[0] in held(index):
                    client.forget([bytes(d) for d in prompt(2, 2)[0].digests])
                    second = save_through(client, 2)
                    await asyncio.sleep(0.05)
                await until(lambda: held(index) == frozenset(second), "the new life's blocks")
                client.close()
            finally:
                process.stop()

    asyncio.run(asyncio.wait_for(main(), 6 * BOUND_S))
