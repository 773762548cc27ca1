"""What an engine's store holds, told as the engine tells its own cache: vLLM KV events.

An engine's own KV events (``--kv-events-config``) say what its device cache
holds; its kvmesh store (`kvmesh.worker.engine_store`) keeps every block the
engine saved long after that cache evicted it, and the engine loads those
blocks through the connector instead of computing them. A router that only
reads the engine's events cannot see them. `StoreEventPublisher` publishes
the store's page events (stored, removed, cleared) in vLLM's own wire
format, so the gateway's `EngineSubscriber` follows a store exactly as it
follows an engine (seq numbers, gaps healed from the replay socket, a
restarted store as a new incarnation):

- frames ``[topic, seq (8 bytes big-endian), payload]`` on a ZMQ PUB socket
  that binds wildcard and ``ipc://`` endpoints and connects to other TCP
  ones (vLLM's rule, `kvmesh.engine_subscriber.engine_binds`), and a ROUTER
  replay socket answering ``[b"", start seq]`` with every buffered batch
  from `start` on, then the end marker;
- payload ``msgpack [ts, [event, ...], 0]``, each event a map tagged
  ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` with medium
  ``"CPU"`` (the index puts the blocks in the engine's host tier), the block
  names the engine's events use: the low 8 bytes of each 32-byte digest,
  big-endian, as an unsigned int (or the whole digest, for engines run with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

A store's seq numbers start at its start time in microseconds, not at 0:
a restarted store (empty) then always continues past the seqs of its last
life, so a subscriber that missed the restart's first batches (a ZMQ
subscriber misses what is sent while a publisher connects) sees a gap that
replay cannot cover, drops the old life's blocks and rebuilds from the new
replay buffer, instead of taking the new life's batches for the old one's
next ones. (A subscriber that joins late is healed the same way.)

A subscriber that joins (a gateway starting, or reconnecting) misses what
was sent before, and a lone lost batch shows no gap. So the PUB socket is
an XPUB that sees each subscription arrive and answers it with an empty
batch: the next seq, which tells the new subscriber where the stream is
(it then replays what it lacks). Other subscribers just apply an empty
batch.

A batch gets its seq when it is published, in the order the store drained
its events, and goes into the replay buffer at once; only then is it queued
for the socket thread. A batch the queue has no room for is therefore a gap
the subscriber sees and heals from replay, never a silent loss (which could
let the index believe the store holds a block it evicted).

ZMQ sockets are not thread-safe: both live on one thread (`start`), which
sends queued batches and answers replay requests; `publish` may be called
from any thread.
"""

from __future__ import annotations

import argparse
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from kvmesh.engine_events import SEQ_BYTES
from kvmesh.engine_subscriber import END_SEQ, engine_binds
from kvmesh.errors import ConfigError, InvariantViolation
from kvmesh.events import AllPagesCleared, KVEvent, PagesRemoved, PagesStored
from kvmesh.metrics import STORE_EVENT_BATCHES
from kvmesh.types import PageHash

if TYPE_CHECKING:
    from kvmesh.worker.engine_store import EngineStore

log = logging.getLogger(__name__)

STORE_MEDIUM = "CPU"
"""vLLM's ``MEDIUM_CPU``: the index keeps a store's blocks in its engine's host tier."""
INT_NAME_BYTES = 8
_POLL_S = 0.05


def block_name(digest: PageHash, int_hashes: bool = True) -> int | bytes:
    """A block as the engine's events name it: its digest's low 8 bytes as an unsigned
    big-endian int (vLLM's default), or the digest itself."""
    if not int_hashes:
        return bytes(digest)
    return int.from_bytes(digest[-INT_NAME_BYTES:], "big")


def _event(ev: KVEvent, medium: str, int_hashes: bool) -> dict[str, Any]:
    if isinstance(ev, PagesStored):
        if len(ev.token_ids) != ev.page_size * len(ev.page_hashes):
            raise InvariantViolation(
                f"a stored event of {len(ev.page_hashes)} blocks carries {len(ev.token_ids)} "
                f"token ids, not {ev.page_size} a block: the store's pool must keep event "
                "token ids (PagePool.event_token_ids) for its events to be published"
            )
        parent = None if ev.parent_hash is None else block_name(ev.parent_hash, int_hashes)
        return {
            "type": "BlockStored",
            "block_hashes": [block_name(h, int_hashes) for h in ev.page_hashes],
            "parent_block_hash": parent,
            "token_ids": list(ev.token_ids),
            "block_size": ev.page_size,
            "lora_id": ev.lora_id,
            "medium": medium,
            "lora_name": None,
        }
    if isinstance(ev, PagesRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [block_name(h, int_hashes) for h in ev.page_hashes],
            "medium": medium,
        }
    if isinstance(ev, AllPagesCleared):
        return {"type": "AllBlocksCleared"}
    raise InvariantViolation(f"not a KV event: {type(ev).__name__}")


def encode_store_batch(
    events: Sequence[KVEvent],
    ts: float,
    *,
    medium: str = STORE_MEDIUM,
    int_hashes: bool = True,
) -> bytes:
    """One batch as vLLM's publisher encodes it (`kvmesh.engine_events` decodes it)."""
    body = [ts, [_event(ev, medium, int_hashes) for ev in events], 0]
    return msgpack.packb(body, use_bin_type=True)


class StoreEventPublisher:
    """Publishes a store's page events as an engine's KV event stream (module docstring).

    `endpoint`: where the gateway listens (``tcp://HOST:PORT``: the gateway
    binds, the store connects) or where the store binds (``ipc://...``,
    ``tcp://*:PORT``). `replay_endpoint` (bound here) keeps the last
    `buffer_batches` batches for subscribers that missed some. `clock` stamps
    each batch; `first_seq` is the first batch's seq (default: now in microseconds, see
    the module docstring).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        name: str = "engine-store",
        int_hashes: bool = True,
        buffer_batches: int = 10_000,
        queue_batches: int = 100_000,
        hwm: int = 100_000,
        clock: Callable[[], float] = time.time,
        first_seq: int | None = None,
    ) -> None:
        for label, value in (("events", endpoint), ("events replay", replay_endpoint)):
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(
                    f"the store's {label} endpoint {value!r} must be tcp://, ipc:// or inproc://"
                )
        if buffer_batches < 1 or queue_batches < 1:
            raise ConfigError("buffer_batches and queue_batches must be >= 1")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.name = name
        self.int_hashes = int_hashes
        self._topic = topic.encode()
        self._hwm = hwm
        self._clock = clock
        self._lock = threading.Lock()
        self._seq = time.time_ns() // 1000 if first_seq is None else first_seq
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(queue_batches)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 10.0) -> StoreEventPublisher:
        """Open both sockets on the publisher's thread; `ConfigError` if one cannot bind."""
        if self._thread is not None:
            return self
        self._ctx = zmq.Context()
        self._thread = threading.Thread(
            target=self._run, name=f"kvmesh-store-events-{self.name}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout) or self._failure is not None:
            self.close()
            raise ConfigError(
                f"store {self.name}: cannot open its event sockets {self.endpoint!r} / "
                f"{self.replay_endpoint!r}: {self._failure or 'timed out'}"
            )
        log.info("store %s publishes its page events on %s (replay %s)",
                 self.name, self.endpoint, self.replay_endpoint)  # fmt: skip
        return self

    def close(self) -> None:
        """Send what is queued, then close the sockets; idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(5.0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> StoreEventPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ publishing

    def publish(self, events: Sequence[KVEvent]) -> int | None:
        """Publish one batch (nothing for no events); its seq. Thread-safe, never blocks on
        the network: callers publish in the order their events happened."""
        if not events:
            return None
        return self._publish(events)

    def _publish(self, events: Sequence[KVEvent]) -> int:
        payload = encode_store_batch(
            events, self._clock(), medium=STORE_MEDIUM, int_hashes=self.int_hashes
        )
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            try:
                self._queue.put_nowait((seq, payload))
            except queue.Full:  # a gap the subscriber heals from the replay buffer
                STORE_EVENT_BATCHES.labels(self.name, "unsent").inc()
        return seq

    def buffered(self, start: int = 0) -> list[tuple[int, bytes]]:
        """The replay buffer's batches from seq `start` on."""
        with self._lock:
            return [(s, p) for s, p in self._buffer if s >= start]

    # ------------------------------------------------------------------ the socket thread

    def _open(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        assert self._ctx is not None
        pub = self._ctx.socket(zmq.XPUB)  # a PUB that sees subscriptions arrive
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's, not only a topic's first
        replay: zmq.Socket[bytes] | None = None
        try:
            if engine_binds(self.endpoint):
                pub.bind(self.endpoint)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError:
            pub.close(0)
            if replay is not None:
                replay.close(0)
            raise
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._open()
        except zmq.ZMQError as exc:
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                while pub.poll(0):
                    if pub.recv()[:1] == b"\x01":  # a subscriber joined: tell it the seq
                        self._publish(())
                if replay is not None and replay.poll(0):
                    self._answer(replay)
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                seq, payload = item
                pub.send_multipart([self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload])
                STORE_EVENT_BATCHES.labels(self.name, "published").inc()
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)

    def _answer(self, replay: zmq.Socket[bytes]) -> None:
        """One replay request: ``[client, b"", start]`` answered as vLLM's publisher does."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != SEQ_BYTES:
            log.warning("store %s: a replay request of %d frames ignored", self.name, len(frames))
            return
        client = frames[0]
        for seq, payload in self.buffered(int.from_bytes(frames[2], "big")):
            replay.send_multipart([client, b"", self._topic, seq.to_bytes(SEQ_BYTES, "big"),
                                   payload])  # fmt: skip
            STORE_EVENT_BATCHES.labels(self.name, "replayed").inc()
        replay.send_multipart([client, b"", b"", END_SEQ, b""])


# ---------------------------------------------------------------------- the store's flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The store's event flags (``python -m kvmesh.worker.engine_store``)."""
    parser.add_argument(
        "--events",
        default=None,
        metavar="ENDPOINT",
        help="publish the store's page events as vLLM KV events here (the gateway's "
        "--store-events: tcp://HOST:PORT is bound by the gateway, ipc:// by the store)",
    )
    parser.add_argument(
        "--events-replay",
        default=None,
        metavar="ENDPOINT",
        help="bind a replay socket here (the gateway's --store-replay), for missed batches",
    )
    parser.add_argument("--events-topic", default="", help="the events' topic (default empty)")
    parser.add_argument(
        "--events-digest-hashes",
        action="store_true",
        help="name blocks by whole digests, as engines run with "
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 do (default: 64-bit ints)",
    )


def attach(store: EngineStore, args: argparse.Namespace) -> StoreEventPublisher | None:
    """Start the publisher the flags ask for and hand it the store's events (None: no flag)."""
    if args.events is None:
        if args.events_replay is not None:
            raise ConfigError("--events-replay needs --events: it replays the events published")
        return None
    publisher = StoreEventPublisher(
        args.events,
        args.events_replay,
        topic=args.events_topic,
        name=store.name,
        int_hashes=not args.events_digest_hashes,
    ).start()
    publish_store_events(store, publisher)
    return publisher


def publish_store_events(store: EngineStore, publisher: StoreEventPublisher) -> None:
    """Make `store` publish every change of its cached set through `publisher`.

    The store's pool then keeps its events' token ids (vLLM's BlockStored
    carries them; 32 ints a block, copied once).
    """
    store.pool.event_token_ids = True
    store.on_events = publisher.publish
