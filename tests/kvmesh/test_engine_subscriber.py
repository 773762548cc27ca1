"""EngineSubscriber against a real ZMQ publisher and replay ROUTER driven by the test.

`Publisher` speaks vLLM's wire protocol (frames ``[topic, seq, payload]``,
msgpack ``[ts, events, dp_rank]``, replay ``[b"", start]`` answered batch by
batch and closed by the ``0xff * 8`` marker); the test decides which frames
reach the subscriber, which the replay buffer still has, and when the
"engine" restarts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq
from prometheus_client import REGISTRY

from kvmesh.coordinator.index import GlobalIndex
from kvmesh.engine_hash import external_to_page_hash
from kvmesh.engine_launcher import free_port
from kvmesh.engine_subscriber import (
    END_SEQ,
    EngineEventsEndpoint,
    EngineSubscriber,
    EngineSubscriberThread,
    SubscriberConfig,
    engine_binds,
    engine_worker_id,
    offset_endpoint,
)
from kvmesh.errors import ConfigError, InvalidInput
from kvmesh.types import PageHash, WorkerId
from tests.async_kit import until

BOUND_S = 10.0


def h(i: int) -> PageHash:
    return external_to_page_hash(i)


def stored(*hashes: int, parent: int | None = None, size: int = 2) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(range(size * len(hashes))),
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


CLEARED = {"type": "AllBlocksCleared"}


class Publisher:
    """An engine's event side: XPUB (a PUB that sees subscriptions) and a replay ROUTER.

    `connect_to` mirrors vLLM with a ``tcp://127.0.0.1:P`` endpoint (the
    engine connects, kvmesh binds); `bind_at` mirrors an ``ipc://`` one.
    """

    def __init__(self, *, connect_to: str | None = None, bind_at: str | None = None,
                 replay_at: str | None = None, topic: bytes = b"kv", rank: int | None = 0) -> None:  # fmt: skip
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to is not None:
            self.pub.connect(connect_to)
        else:
            assert bind_at is not None
            self.pub.bind(bind_at)
        self.topic = topic
        self.rank = rank
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.replay_requests: list[int] = []
        self.answer_replay = True
        self.replay_with_topic = True  # vLLM's replay frames; SGLang's carry no topic
        self.stopping = threading.Event()
        self.replay_thread: threading.Thread | None = None
        if replay_at is not None:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_at)
            self.replay_thread = threading.Thread(target=self._serve_replay, daemon=True)
            self.replay_thread.start()

    def wait_subscribed(self) -> None:
        """Block until the subscriber's subscription arrived, so no batch is lost to a slow join."""
        if not self.pub.poll(BOUND_S * 1000):
            raise TimeoutError("no subscriber subscribed")
        self.pub.recv()

    def _serve_replay(self) -> None:
        while not self.stopping.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            if not self.answer_replay:
                continue
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= first]
            head = [client, b""] + ([self.topic] if self.replay_with_topic else [])
            for s, p in items:
                self.router.send_multipart([*head, s.to_bytes(8, "big"), p])
            self.router.send_multipart([*head[:2], *([b""] if self.replay_with_topic else []),
                                        END_SEQ, b""])  # fmt: skip

    def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        with self.lock:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def publish(self, *events: dict[str, Any] | list[Any], send: bool = True) -> int:
        """Publish one batch; `send=False` keeps it only in the replay buffer (lost on the wire)."""
        body: list[Any] = [time.time(), list(events)]
        if self.rank is not None:
            body.append(self.rank)
        return self.publish_payload(msgpack.packb(body), send=send)

    def forget_before(self, seq: int) -> None:
        """The replay buffer no longer has batches before `seq` (it is bounded)."""
        with self.lock:
            self.buffer = [(s, p) for s, p in self.buffer if s >= seq]

    def restart(self) -> None:
        """A new engine life: seq from 0, an empty replay buffer."""
        self.seq = 0
        with self.lock:
            self.buffer = []

    def close(self) -> None:
        self.stopping.set()
        if self.replay_thread is not None:
            self.replay_thread.join(5)
            self.router.close(0)
        self.pub.close(0)
        self.ctx.term()


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name + "_total", labels) or 0.0


Scenario = Callable[[GlobalIndex, EngineSubscriber, Publisher], Awaitable[None]]


def run_scenario(
    scenario: Scenario,
    *,
    engine_id: str = "engine-0",
    replay: bool = True,
    rank: int = 0,
    drop: Callable[[WorkerId, int], bool] | None = None,
    config: SubscriberConfig | None = None,
    topic: str = "kv",
) -> None:
    """One subscriber bound on a fresh port, one publisher (of `rank`) connecting to it."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_at = f"tcp://127.0.0.1:{free_port()}" if replay else None
    index = GlobalIndex()

    async def main() -> None:
        sub = EngineSubscriber(
            index,
            [EngineEventsEndpoint(engine_id, endpoint, replay_at, topic, (rank,))],
            config=config or SubscriberConfig(replay_timeout_s=2.0),
            drop_frame=drop,
        )
        await sub.start()
        pub = Publisher(
            connect_to=offset_endpoint(endpoint, rank),
            replay_at=None if replay_at is None else offset_endpoint(replay_at, rank),
            rank=rank,
        )
        try:
            await asyncio.get_running_loop().run_in_executor(None, pub.wait_subscribed)
            await scenario(index, sub, pub)
        finally:
            await sub.stop()
            pub.close()

    asyncio.run(asyncio.wait_for(main(), 3 * BOUND_S))


def applied(index: GlobalIndex, wid: str = "engine-0") -> int:
    """The last seq the index applied for `wid` (-1 before it knows the worker)."""
    if WorkerId(wid) not in index.workers():
        return -1
    return index.worker_state(WorkerId(wid)).last_seq


def pages(index: GlobalIndex, wid: str = "engine-0") -> frozenset[PageHash]:
    """What the index holds for `wid` (nothing before it knows the worker)."""
    return index.worker_pages(WorkerId(wid)) if WorkerId(wid) in index.workers() else frozenset()


def fresh_at(index: GlobalIndex, seq: int) -> Callable[[], bool]:
    """The index applied engine-0's batches up to `seq` and trusts it."""
    return lambda: applied(index) == seq and not index.is_stale(WorkerId("engine-0"))


def seen(sub: EngineSubscriber, wid: str, seq: int) -> Callable[[], bool]:
    return lambda: sub.stream_state(WorkerId(wid)).last_seq >= seq


# ---------------------------------------------------------------- endpoints


def test_subscriber_binds_what_vllm_connects_to_and_connects_what_it_binds() -> None:
    assert not engine_binds("tcp://127.0.0.1:5557")
    assert engine_binds("tcp://*:5557") and engine_binds("ipc:///tmp/kv") and engine_binds("inproc://x")
    (tcp,) = EngineEventsEndpoint("e", "tcp://127.0.0.1:5557").streams()
    (ipc,) = EngineEventsEndpoint("e", "ipc:///tmp/kv").streams()
    assert tcp.bind and not ipc.bind


def test_data_parallel_ranks_get_offset_endpoints_and_their_own_worker_ids() -> None:
    ep = EngineEventsEndpoint("e", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:6000",
                              data_parallel_ranks=(0, 2))  # fmt: skip
    assert [(s.worker_id, s.endpoint, s.replay_endpoint) for s in ep.streams()] == [
        ("e", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:6000"),
        ("e@dp2", "tcp://127.0.0.1:5559", "tcp://127.0.0.1:6002"),
    ]
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert engine_worker_id("e", None) == engine_worker_id("e", 0) == "e"


def test_bad_endpoints_are_config_errors_that_say_what_to_give() -> None:
    with pytest.raises(ConfigError, match="reachable address"):
        EngineEventsEndpoint("e", "tcp://*:5557")
    with pytest.raises(ConfigError, match="tcp://"):
        EngineEventsEndpoint("e", "http://127.0.0.1:5557")
    with pytest.raises(ConfigError, match="'@'"):
        EngineEventsEndpoint("e@x", "tcp://127.0.0.1:1")
    EngineEventsEndpoint("e", "tcp://10.0.0.5:5557", mode="connect")


def test_following_one_engine_twice_is_refused() -> None:
    ep = EngineEventsEndpoint("e", "tcp://127.0.0.1:5557")
    with pytest.raises(InvalidInput, match="already followed"):
        EngineSubscriber(GlobalIndex(), [ep, ep])


# ---------------------------------------------------------------- in order


def test_batches_in_order_build_the_engines_blocks_in_the_index() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        pub.publish(stored(1, 2))
        pub.publish(stored(3, parent=2), removed(1))
        await until(seen(sub, "engine-0", 1), "two batches")
        assert index.worker_pages(WorkerId("engine-0")) == {h(2), h(3)}
        assert index.parent(h(3)) == h(2)
        state = sub.stream_state(WorkerId("engine-0"))
        assert not state.stale and state.last_seq == 1 and not state.healing
        assert pub.replay_requests == []

    run_scenario(scenario)


def test_all_blocks_cleared_empties_the_engines_entries() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        pub.publish(stored(1, 2))
        pub.publish(CLEARED, stored(9))
        await until(seen(sub, "engine-0", 1), "two batches")
        assert index.worker_pages(WorkerId("engine-0")) == {h(9)}

    run_scenario(scenario)


def test_a_data_parallel_rank_feeds_its_own_index_worker() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        pub.publish(stored(5))
        await until(seen(sub, "engine-3@dp1", 0), "rank 1's batch")
        assert index.holders(h(5)) == {"engine-3@dp1": ("gpu",)}

    run_scenario(scenario, engine_id="engine-3", rank=1)


def test_listeners_see_each_decoded_batch() -> None:
    got: list[tuple[str, int]] = []

    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        sub.add_listener(lambda wid, batch: got.append((wid, batch.seq)))
        pub.publish(stored(1))
        pub.publish(stored(2, parent=1))
        await until(lambda: len(got) == 2, "two listener calls")
        assert got == [("engine-0", 0), ("engine-0", 1)]

    run_scenario(scenario)


# ---------------------------------------------------------------- gaps


def test_listeners_see_a_live_batch_kept_aside_during_a_replay_on_arrival() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        wid = WorkerId("engine-0")
        got: list[int] = []
        sub.add_listener(lambda w, batch: got.append(batch.seq))
        pub.answer_replay = False
        pub.publish(stored(1), send=False)
        pub.publish(stored(2))  # past a gap: a replay starts, and the engine stays silent
        await until(lambda: sub.stream_state(wid).healing, "a replay")
        pub.publish(stored(3))
        await until(lambda: 2 in got, "the kept batch reaching the listener")
        assert sub.stream_state(wid).healing and h(3) not in index  # the index waits for it

    run_scenario(scenario, config=SubscriberConfig(replay_timeout_s=5.0))


def test_a_lost_batch_is_healed_from_the_replay_socket() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        before = counter("kvmesh_engine_event_gaps", engine="engine-0", outcome="healed")
        pub.publish(stored(1, 2))
        pub.publish(stored(3, parent=2), removed(1), send=False)  # lost on the wire
        pub.publish(stored(4, parent=3))
        await until(fresh_at(index, 2), "healing")
        assert index.worker_pages(WorkerId("engine-0")) == {h(2), h(3), h(4)}
        assert pub.replay_requests == [1]
        assert counter("kvmesh_engine_event_gaps", engine="engine-0", outcome="healed") == before + 1

    run_scenario(scenario)


def test_the_engine_is_stale_while_a_gap_is_open() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        pub.answer_replay = False
        pub.publish(stored(1))
        pub.publish(stored(2, parent=1), send=False)
        pub.publish(stored(3, parent=2))
        await until(lambda: bool(pub.replay_requests), "a replay request")
        state = sub.stream_state(WorkerId("engine-0"))
        assert state.stale and state.healing
        assert index.is_stale(WorkerId("engine-0"))

    run_scenario(scenario, config=SubscriberConfig(replay_timeout_s=5.0))


def test_a_gap_the_replay_buffer_no_longer_covers_drops_the_entries_and_follows_afresh() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        wid = WorkerId("engine-0")
        before = counter("kvmesh_engine_event_gaps", engine="engine-0", outcome="uncovered")
        pub.publish(stored(1, 2))
        pub.publish(removed(2), send=False)  # a removal kvmesh never learns of
        pub.forget_before(2)
        pub.publish(stored(7))
        await until(lambda: counter("kvmesh_engine_event_gaps", engine="engine-0",
                                    outcome="uncovered") == before + 1, "uncovered gap")  # fmt: skip
        await until(lambda: not index.is_stale(wid), "fresh again")
        assert h(2) not in index  # no phantom block: the index holds a subset of the engine
        pub.publish(stored(8, parent=7))
        await until(seen(sub, "engine-0", 3), "the next batch")
        await until(lambda: h(8) in pages(index), "the next batch applied")
        assert not index.is_stale(wid)

    run_scenario(scenario)


def test_a_silent_replay_socket_counts_as_uncovered_after_its_timeout() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        pub.answer_replay = False
        pub.publish(stored(1))
        pub.publish(stored(2, parent=1), send=False)
        pub.publish(stored(3, parent=2))
        await until(fresh_at(index, 2), "giving up on replay")
        assert index.worker_pages(WorkerId("engine-0")) == set()

    run_scenario(scenario, config=SubscriberConfig(replay_timeout_s=0.3))


def test_without_a_replay_endpoint_a_gap_resyncs_at_once() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        pub.publish(stored(1))
        pub.publish(removed(1), send=False)
        pub.publish(stored(3))
        await until(fresh_at(index, 2), "resync")
        assert h(1) not in index

    run_scenario(scenario, replay=False)


def test_a_subscriber_that_joins_late_replays_the_engines_history_from_seq_0() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        pub.publish(stored(1, 2), send=False)
        pub.publish(stored(3, parent=2), send=False)
        pub.publish(removed(1))
        await until(lambda: applied(index) == 2, "replay")
        assert index.worker_pages(WorkerId("engine-0")) == {h(2), h(3)}
        assert pub.replay_requests == [0]

    run_scenario(scenario)


class LiveTraffic:
    """An engine that keeps serving: one batch (a new block, every third one evicting an
    older block) every `period_s`, on a thread, while the test waits on the subscriber."""

    def __init__(self, pub: Publisher, period_s: float = 0.002) -> None:
        self.pub = pub
        self.period_s = period_s
        self.held: set[int] = set()
        self.stored_at: dict[int, int] = {}  # block -> the seq of the batch that stored it
        self.next_block = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def one(self, *, send: bool = True) -> int:
        block = self.next_block
        self.next_block += 1
        events: list[dict[str, Any]] = [stored(block)]
        self.held.add(block)
        if block % 3 == 2:
            events.append(removed(block - 2))
            self.held.discard(block - 2)
        self.stored_at[block] = self.pub.seq
        return self.pub.publish(*events, send=send)

    def _run(self) -> None:
        while not self.stopping.wait(self.period_s):
            self.one()

    def __enter__(self) -> LiveTraffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(5)


def test_a_late_join_behind_a_long_history_and_live_traffic_reaches_affinity_again() -> None:
    """vLLM answers a replay by pushing its whole buffer through a ROUTER at once (messages
    past the socket's high-water mark are dropped, the end marker with them) and goes on
    publishing meanwhile; a subscriber that joins after thousands of batches still ends up
    holding exactly what the engine holds, with nothing held back."""

    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        wid = WorkerId("engine-0")
        engine = LiveTraffic(pub)
        for _ in range(6000):  # before the join: only the replay buffer has them
            engine.one(send=False)
        with engine:
            await until(lambda: sub.stream_state(wid).last_seq >= 6100, "live traffic")
            await until(lambda: not index.is_stale(wid), "fresh again")
        last = engine.pub.seq - 1
        await until(fresh_at(index, last), "the last live batch")
        assert index.worker_pages(wid) == {h(b) for b in engine.held}
        assert index.worker_state(wid).pending_batches == 0

    run_scenario(scenario)


def test_more_live_batches_during_a_replay_than_the_heal_backlog_follow_afresh() -> None:
    """A replay that cannot keep up gives up on the gap: the index drops the engine's
    entries, holds only what the engine still holds, and follows the live stream."""

    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        wid = WorkerId("engine-0")
        before = counter("kvmesh_engine_event_gaps", engine="engine-0", outcome="uncovered")
        pub.answer_replay = False  # the replay never catches up with the live stream
        engine = LiveTraffic(pub)
        for _ in range(100):
            engine.one(send=False)
        with engine:
            await until(lambda: sub.stream_state(wid).last_seq >= 200, "live traffic")
        await until(fresh_at(index, engine.pub.seq - 1), "the last live batch")
        assert index.worker_pages(wid) <= {h(b) for b in engine.held}
        assert h(engine.next_block - 1) in index.worker_pages(wid)
        assert index.worker_state(wid).pending_batches == 0
        assert counter("kvmesh_engine_event_gaps", engine="engine-0", outcome="uncovered") > before

    run_scenario(scenario, config=SubscriberConfig(replay_timeout_s=5.0, heal_backlog=16))


def test_a_late_join_behind_more_history_than_the_replay_buffer_rebuilds_from_its_oldest() -> None:
    """The buffer has lost the first batches: the index holds what the engine announced
    from the buffer's oldest batch on and still holds (a subset), and is fresh again."""

    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        wid = WorkerId("engine-0")
        engine = LiveTraffic(pub)
        for _ in range(5000):
            engine.one(send=False)
        oldest = 3000
        pub.forget_before(oldest)
        with engine:
            await until(lambda: sub.stream_state(wid).last_seq >= 5100, "live traffic")
            await until(lambda: not index.is_stale(wid), "fresh again")
        await until(fresh_at(index, engine.pub.seq - 1), "the last live batch")
        announced = {b for b in engine.held if engine.stored_at[b] >= oldest}
        assert index.worker_pages(wid) == {h(b) for b in announced}
        assert index.worker_state(wid).pending_batches == 0

    run_scenario(scenario)


def test_subscriber_config_refuses_replay_settings_that_cannot_work() -> None:
    with pytest.raises(ConfigError, match="replay_idle_s"):
        SubscriberConfig(replay_idle_s=0)
    with pytest.raises(ConfigError, match="heal_backlog"):
        SubscriberConfig(heal_backlog=0)


def test_an_engine_quarantined_during_a_replay_stays_without_entries() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        wid = WorkerId("engine-0")
        uncovered = counter("kvmesh_engine_event_gaps", engine="engine-0", outcome="uncovered")
        engine = LiveTraffic(pub)
        for _ in range(6000):
            engine.one(send=False)
        engine.one()
        await until(lambda: sub.stream_state(wid).healing, "a replay")
        sub.quarantine("engine-0", "a failed canary")
        await until(lambda: not sub.stream_state(wid).healing, "the replay giving up")
        assert index.is_stale(wid) and index.worker_pages(wid) == frozenset()
        assert counter("kvmesh_engine_event_gaps", engine="engine-0", outcome="uncovered") == uncovered

    run_scenario(scenario)


def test_an_empty_topic_follows_an_engine_publishing_on_any_topic() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        pub.publish(stored(1))  # the publisher's topic is "kv"
        await until(fresh_at(index, 0), "the batch")
        assert index.worker_pages(WorkerId("engine-0")) == {h(1)}

    run_scenario(scenario, topic="")


def test_frames_dropped_by_the_fault_hook_are_healed_like_lost_ones() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        for i in range(4):
            pub.publish(stored(10 + i, parent=9 + i if i else None))
        await until(fresh_at(index, 3), "healing")
        assert index.worker_pages(WorkerId("engine-0")) == {h(10), h(11), h(12), h(13)}

    run_scenario(scenario, drop=lambda wid, seq: seq == 1)


def test_an_sglang_style_stream_of_array_events_decodes_and_heals() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        pub.rank = None  # SGLang's batches are [ts, events]
        pub.replay_with_topic = False
        pub.publish(["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None])
        pub.publish(["BlockRemoved", [1]], send=False)
        pub.publish(["BlockStored", [3], 2, [5, 6], 2, None])
        await until(fresh_at(index, 2), "healing")
        assert pages(index) == {h(2), h(3)}
        assert pub.replay_requests == [1]

    run_scenario(scenario)


# ---------------------------------------------------------------- restarts


def test_a_restarted_engine_is_a_new_incarnation_not_a_gap() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        wid = WorkerId("engine-0")
        restarts = counter("kvmesh_engine_restarts", engine="engine-0")
        pub.publish(stored(1))
        pub.publish(stored(2, parent=1))
        pub.publish(stored(3, parent=2))
        await until(seen(sub, "engine-0", 2), "first life")
        first_life = sub.stream_state(wid).incarnation
        pub.restart()
        pub.publish(CLEARED, stored(20))
        await until(lambda: sub.stream_state(wid).incarnation != first_life, "a new incarnation")
        await until(lambda: h(20) in index, "the new life's block")
        assert index.worker_pages(wid) == {h(20)}
        assert not index.is_stale(wid)
        assert pub.replay_requests == []
        assert counter("kvmesh_engine_restarts", engine="engine-0") == restarts + 1

    run_scenario(scenario)


def test_a_restart_whose_first_batches_were_lost_replays_the_new_life() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        for i in range(3):
            pub.publish(stored(i + 1))
        await until(seen(sub, "engine-0", 2), "first life")
        pub.restart()
        pub.publish(stored(30), send=False)
        pub.publish(stored(31, parent=30))
        await until(lambda: pages(index) == {h(30), h(31)}, "the new life replayed")
        assert pub.replay_requests == [0]

    run_scenario(scenario)


# ---------------------------------------------------------------- bad input


def test_a_bad_payload_is_counted_dropped_and_never_half_applied() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        wid = WorkerId("engine-0")
        bad = counter("kvmesh_engine_bad_payloads", engine="engine-0", reason="decode")
        pub.publish(stored(1))
        half_bad = msgpack.packb([time.time(), [stored(5), {"type": "BlockRemoved"}], 0])
        pub.publish_payload(half_bad)
        pub.publish_payload(b"\xc1 not msgpack")
        await until(lambda: counter("kvmesh_engine_bad_payloads", engine="engine-0",
                                    reason="decode") == bad + 2, "two bad payloads")  # fmt: skip
        assert h(5) not in index  # nothing of the bad batch
        assert h(1) not in index  # a lost batch may have removed it: entries dropped
        pub.publish(stored(6))
        await until(lambda: h(6) in pages(index), "the stream goes on")
        assert not index.is_stale(wid)

    run_scenario(scenario)


def test_bad_frames_are_counted_by_reason_and_the_stream_goes_on() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        frames = counter("kvmesh_engine_bad_payloads", engine="engine-0", reason="frame")
        seqs = counter("kvmesh_engine_bad_payloads", engine="engine-0", reason="seq")
        pub.pub.send_multipart([b"kv", b"only two"])
        pub.pub.send_multipart([b"kv", b"\x00\x01", b"payload"])
        pub.publish(stored(1))
        await until(lambda: h(1) in pages(index), "a good batch after bad frames")
        assert counter("kvmesh_engine_bad_payloads", engine="engine-0", reason="frame") == frames + 1
        assert counter("kvmesh_engine_bad_payloads", engine="engine-0", reason="seq") == seqs + 1

    run_scenario(scenario)


def test_a_batch_of_another_dp_rank_on_this_stream_is_refused() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        before = counter("kvmesh_engine_bad_payloads", engine="engine-0", reason="dp_rank")
        pub.rank = 1
        pub.publish(stored(1))
        await until(lambda: counter("kvmesh_engine_bad_payloads", engine="engine-0",
                                    reason="dp_rank") == before + 1, "refusal")  # fmt: skip
        assert h(1) not in index

    run_scenario(scenario)


# ---------------------------------------------------------------- quarantine


def test_a_quarantined_engine_gets_no_entries_until_released() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        wid = WorkerId("engine-0")
        pub.publish(stored(1))
        await until(lambda: h(1) in index, "first batch")
        sub.quarantine("engine-0", "hash parity failed")
        assert h(1) not in index and index.is_stale(wid)
        assert sub.quarantined("engine-0") == "hash parity failed"
        pub.publish(stored(2))
        await until(seen(sub, "engine-0", 1), "second batch")
        assert h(2) not in index and sub.stream_state(wid).stale
        sub.release("engine-0")
        assert not index.is_stale(wid) and sub.quarantined("engine-0") is None
        pub.publish(stored(3))
        await until(lambda: h(3) in index, "batches applied again")

    run_scenario(scenario)


def test_an_engine_quarantined_before_its_first_batch_stays_without_affinity() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        sub.quarantine("engine-0", "no events for the canary")
        assert index.is_stale(WorkerId("engine-0"))
        pub.publish(stored(1))
        await until(seen(sub, "engine-0", 0), "the first batch")
        assert h(1) not in index and index.is_stale(WorkerId("engine-0"))

    run_scenario(scenario)


# ---------------------------------------------------------------- lifecycle


def test_an_ipc_endpoint_is_connected_to_where_the_engine_binds(tmp_path: Any) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events"
    index = GlobalIndex()

    async def main() -> None:
        pub = Publisher(bind_at=endpoint)
        sub = EngineSubscriber(index, [EngineEventsEndpoint("engine-0", endpoint, None, "kv")])
        await sub.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, pub.wait_subscribed)
            pub.publish(stored(4))
            await until(lambda: h(4) in index, "a batch over ipc")
        finally:
            await sub.stop()
            pub.close()

    asyncio.run(asyncio.wait_for(main(), BOUND_S))


def test_engines_can_be_added_and_removed_while_running() -> None:
    async def scenario(index: GlobalIndex, sub: EngineSubscriber, pub: Publisher) -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        await sub.add_engine(EngineEventsEndpoint("engine-1", endpoint, None, "kv"))
        other = Publisher(connect_to=endpoint)
        try:
            await asyncio.get_running_loop().run_in_executor(None, other.wait_subscribed)
            other.publish(stored(11))
            await until(lambda: h(11) in index, "the added engine's batch")
            assert sub.engines() == ["engine-0", "engine-1"]
            await sub.remove_engine("engine-1")
            assert h(11) not in index and "engine-1" not in index.workers()
        finally:
            other.close()

    run_scenario(scenario)


def test_the_thread_runner_follows_events_without_an_event_loop_in_the_caller() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = GlobalIndex()
    runner = EngineSubscriberThread(
        EngineSubscriber(index, [EngineEventsEndpoint("engine-0", endpoint, None, "kv")])
    )
    runner.start()
    pub = Publisher(connect_to=endpoint)
    try:
        pub.wait_subscribed()
        pub.publish(stored(1))
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            with runner.subscriber.lock:
                if h(1) in index:
                    break
            time.sleep(0.01)
        with runner.subscriber.lock:
            assert index.worker_pages(WorkerId("engine-0")) == {h(1)}
    finally:
        runner.stop()
        pub.close()


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = {t.name for t in threading.enumerate()}
    yield
    leaked = {t.name for t in threading.enumerate()} - before
    assert not {n for n in leaked if n.startswith("kvmesh-engine-events")}
